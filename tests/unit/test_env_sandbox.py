"""The env engine's tools: the sandboxed `python` tool kills runaway code within its limits and answers with an
error observation; the calculator never evals; user tools are checked against their JSON schema; environments
keep per-episode state."""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

import pytest

from services.common.errors import NotFound
from services.common.tool_calls import ToolCall
from services.env.calculator import evaluate
from services.env.config import EnvSettings
from services.env.engine import EnvEngine
from services.env.types import ToolError

LIMITS = {"timeout_s": 4, "cpu_s": 2, "memory_mb": 512, "max_output_bytes": 2048, "max_processes": 16}


@pytest.fixture(scope="module", autouse=True)
def own_workdirs(tmp_path_factory):
    """The sandbox's working directories under a folder of this module's own, so that the sandbox processes of
    other test runs on the machine are not counted as this one's."""
    saved, tempfile.tempdir = tempfile.tempdir, str(tmp_path_factory.mktemp("sandbox_workdirs"))
    yield tempfile.tempdir
    tempfile.tempdir = saved


def _sandbox_processes() -> list[int]:
    """Processes still running the sandbox of this module's calls (forked children keep its command line and its
    working directory)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if b"sandbox_child.py" in Path(f"/proc/{pid}/cmdline").read_bytes() and \
                    os.readlink(f"/proc/{pid}/cwd").startswith(tempfile.gettempdir()):
                found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.fixture(scope="module")
def engine():
    eng = EnvEngine(EnvSettings(env={"python": LIMITS}))
    yield eng
    asyncio.run(eng.close())


def _call(engine: EnvEngine, name: str, **arguments):
    return asyncio.run(engine.call_tools([ToolCall(name=name, arguments=arguments, id="c")]))[0]


def test_python_prints_and_shows_a_last_expression(engine):
    result = _call(engine, "python", code="x = 6\nprint('hi')\nx * 7")
    assert (result.error, result.content) == ("", "hi\n42\n")


def _isolated(engine: EnvEngine) -> bool:
    """Whether this replica's sandbox has its namespaces (else the best-effort fallback: GetInfo says which)."""
    return "network namespace" in engine.info()["python_sandbox"]


NO_ROUTE = "OSError: [Errno 101] Network is unreachable"
NO_SOCKET = "PermissionError: network access is disabled in the python tool"


# Each runaway is stopped by the limit meant for it, with that limit's own error (namespaced, fallback).
@pytest.mark.parametrize("code, namespaced, fallback", [
    ("x = bytearray(10 * 2**30)", "MemoryError", "MemoryError"),
    # the process limit stops a fork bomb: fork fails with EAGAIN long before any time limit
    ("import os\nwhile True:\n    os.fork()", "BlockingIOError: [Errno 11] Resource temporarily unavailable",
     "BlockingIOError: [Errno 11] Resource temporarily unavailable"),
    ("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=3)", NO_ROUTE, NO_SOCKET),
    # with no interface the name lookup cannot reach a resolver; without sockets nothing is even tried
    ("import urllib.request\nurllib.request.urlopen('http://example.com', timeout=3)",
     "urllib.error.URLError: <urlopen error [Errno -3] Temporary failure in name resolution>", NO_SOCKET),
    ("import urllib.request\nurllib.request.urlopen('http://1.1.1.1', timeout=3)",
     "urllib.error.URLError: <urlopen error [Errno 101] Network is unreachable>", NO_SOCKET),
    ("print('x' * 100000)", "output past env.python.max_output_bytes (2048 bytes)",
     "output past env.python.max_output_bytes (2048 bytes)"),
    ("import time\ntime.sleep(60)", "timed out after 4s", "timed out after 4s"),
])
def test_the_sandbox_kills_runaway_code_and_answers_with_an_error_observation(engine, code, namespaced, fallback):
    result = _call(engine, "python", code=code)
    assert result.error, result.content
    assert result.content.startswith("Error: ")
    assert (namespaced if _isolated(engine) else fallback) in result.error, result.error
    assert _sandbox_processes() == []          # nothing it started lives on
    # The tool still serves the next call.
    assert _call(engine, "python", code="print(1 + 1)").content == "2\n"


def test_an_endless_loop_is_stopped_by_a_limit(engine):
    # CPU seconds (cpu_s 2) come first on an idle machine, wall time (timeout_s 4) on a busy one: both are limits
    result = _call(engine, "python", code="while True:\n    pass")
    assert result.error.startswith(("killed: CPU time limit of 2s", "timed out after 4s")), result.error
    assert _sandbox_processes() == []


def test_sandboxed_code_writes_only_its_working_directory_which_is_removed(engine, tmp_path):
    code = ("import os\nopen('f.txt', 'w').write('x')\nprint(os.getcwd())\n"
            f"for path in ({str(tmp_path / 'outside.txt')!r}, '/tmp/meshrl-sandbox-escape.txt', "
            f"os.path.join(os.path.dirname(os.getcwd()), 'sibling.txt')):\n"
            "    try:\n        open(path, 'w').write('x')\n        print('wrote', path)\n"
            "    except OSError as e:\n        print('refused', e.errno)\n")
    result = _call(engine, "python", code=code)
    assert result.error == ""
    workdir, *outcomes = result.content.strip().splitlines()
    assert not Path(workdir).exists()
    if not _isolated(engine):
        pytest.skip("no namespaces here: the fallback sandbox does not isolate the filesystem (GetInfo says so)")
    assert "read-only filesystem but its working directory" in engine.info()["python_sandbox"]
    assert outcomes == ["refused 30"] * 3                    # EROFS, even for root
    assert not (tmp_path / "outside.txt").exists() and not Path("/tmp/meshrl-sandbox-escape.txt").exists()


def test_the_engine_answers_every_call_in_order_even_when_some_fail(engine):
    calls = [ToolCall(name="calculator", arguments={"expression": "123 * 456"}, id="a"),
             ToolCall(name="nope", arguments={}, id="b"),
             ToolCall(name="calculator", arguments={"expr": "1"}, id="c"),
             ToolCall(name="python", arguments={"code": "raise ValueError('boom')"}, id="d")]
    results = asyncio.run(engine.call_tools(calls))
    assert [r.id for r in results] == ["a", "b", "c", "d"]
    assert (results[0].content, results[0].error) == ("56088", "")
    assert "unknown tool 'nope'" in results[1].error
    assert "calculator takes exactly {'expression': str}" in results[2].error
    assert "ValueError: boom" in results[3].error


@pytest.mark.parametrize("expression, value", [("2**10", 1024), ("(1 + 2) * 3 - 4 / 2", 7.0), ("(-3) ^ 2", 9),
                                               ("-3 ^ 2", -9), ("sqrt(16) + abs(-2)", 6.0), ("7 // 2 + 7 % 2", 4)])
def test_the_calculator_evaluates_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression, error", [
    ("__import__('os').system('true')", "Call is not allowed"), ("9**9**9", "more than 1000 digits"),
    ("1/0", "division by zero"), ("x + 1", "Name is not allowed"), ("1 +", "not arithmetic"),
    ("[1, 2]", "List is not allowed"), ("round(2.5, 10**9)", "takes 1 positional argument"),
])
def test_the_calculator_refuses_anything_but_arithmetic(expression, error):
    with pytest.raises((ToolError, TypeError), match=error.replace("*", r"\*").replace("(", r"\(")):
        evaluate(expression)


def test_a_user_tool_is_called_with_schema_checked_arguments(tmp_path):
    (tmp_path / "weather.py").write_text(
        "def forecast(city, days=1, episode_id=''):\n    return f'{city}: sunny for {days} days ({episode_id})'\n")
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
              "required": ["city"], "additionalProperties": False}
    eng = EnvEngine(EnvSettings(env={"builtin_tools": ["calculator"], "tools": [
        {"name": "forecast", "function": f"{tmp_path}/weather.py:forecast", "parameters": schema}]}))
    assert [t["function"]["name"] for t in eng.list_tools()] == ["calculator", "forecast"]
    ok, bad = asyncio.run(eng.call_tools([ToolCall(name="forecast", arguments={"city": "Oslo", "days": 2}, id="1"),
                                          ToolCall(name="forecast", arguments={"city": "Oslo", "days": "2"}, id="2")],
                                         episode_id="ep1"))
    assert ok.content == "Oslo: sunny for 2 days (ep1)"
    assert bad.error.startswith("arguments['days']: '2' is not of type 'integer'")


def test_a_user_tool_that_cannot_load_is_refused_naming_its_key():
    with pytest.raises(ValueError, match=r"env.tools\[0\].function: cannot|env.tools\[0\].function: importing"):
        EnvEngine(EnvSettings(env={"builtin_tools": [], "tools": [{"name": "t", "function": "no_such_mod:fn"}]}))


def test_an_environment_keeps_state_per_episode_and_drops_it_when_done():
    eng = EnvEngine(EnvSettings(env={"builtin_tools": []}))

    async def play():
        first = await eng.reset("ep", "guess_number", {"low": 1, "high": 4, "seed": 0})
        other = await eng.reset("ep2", "guess_number", {"low": 1, "high": 4, "seed": 0})
        steps = []
        for guess in range(1, 5):
            steps.append(await eng.step("ep", str(guess)))
            if steps[-1].done:
                break
        return first, other, steps

    first, other, steps = asyncio.run(play())
    assert first.startswith("I picked a number between 1 and 4")
    assert steps[-1].done and steps[-1].reward == 1.0 and all(s.reward == 0.0 for s in steps[:-1])
    assert "ep" not in eng.episodes.episodes and "ep2" in eng.episodes.episodes
    with pytest.raises(NotFound, match="episode_id: no episode 'ep' on this replica"):
        asyncio.run(eng.step("ep", "1"))
    assert asyncio.run(eng.end("ep2")) is True and asyncio.run(eng.end("ep2")) is False


def test_a_network_namespace_that_cannot_be_had_is_refused_by_name(monkeypatch):
    import services.env.sandbox as sandbox

    monkeypatch.setattr(sandbox, "probe_namespaces", lambda: False)
    with pytest.raises(ValueError, match="env.python.network: 'namespace' cannot be honoured"):
        EnvEngine(EnvSettings(env={"python": {"network": "namespace"}}))
    # auto falls back to disabling sockets inside the process, and says so.
    eng = EnvEngine(EnvSettings(env={"builtin_tools": ["python"]}))
    assert "socket module disabled (best effort)" in eng.info()["python_sandbox"]
    result = _call(eng, "python", code="import socket\nsocket.socket()")
    assert "network access is disabled in the python tool" in result.error


@pytest.mark.parametrize("env, message", [
    ({"builtin_tools": ["shell"]}, "env.builtin_tools: unknown tool 'shell'"),
    ({"tool_call_parser": "llama"}, "env.tool_call_parser: unknown parser 'llama'"),
    ({"builtin_tools": ["calculator"], "tools": [{"name": "calculator", "function": "m:f"}]},
     "env.tools[0].name: 'calculator' is already a tool of this replica"),
    ({"environments": {"maze": "mazes"}}, "env.environments.maze: 'mazes' is not 'package.module:Class'"),
])
def test_bad_env_settings_name_their_key(env, message):
    from services.common.config import load_config

    with pytest.raises(ValueError) as err:
        load_config(EnvSettings, data={"env": env})
    assert message in str(err.value)


@pytest.mark.skipif(os.geteuid() != 0, reason="the seccomp fallback is for a root service (others get RLIMIT_NPROC)")
def test_root_without_a_pids_cgroup_may_start_threads_but_no_process(monkeypatch):
    import services.env.sandbox as sandbox

    monkeypatch.setattr(sandbox, "probe_cgroup_base", lambda: None)
    eng = EnvEngine(EnvSettings(env={"builtin_tools": ["python"], "python": LIMITS}))
    assert "no new processes (seccomp" in eng.info()["python_sandbox"]
    code = ("import os, subprocess, threading\nt = threading.Thread(target=print, args=('thread',))\nt.start()\n"
            "t.join()\ntry:\n    subprocess.run(['true'])\nexcept OSError as e:\n    print('spawn', e.errno)\n"
            "while True:\n    os.fork()")
    result = _call(eng, "python", code=code)
    assert result.error.startswith("thread\nspawn 11\n")
    assert "BlockingIOError" in result.error
    assert _sandbox_processes() == []
