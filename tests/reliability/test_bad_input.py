"""Malformed config files and datasets fail fast, naming the file, the line or the key."""

import asyncio
import os
import subprocess
import sys

import grpc
import pytest
import yaml

from coordinator.client import Client
from coordinator.runapi.service import CoordinatorSettings, start as start_coordinator
from services.common.config import load_config

from tests.reliability.procs import REPO, TRAIN

pytestmark = pytest.mark.slow

MODULES = {"coordinator": "coordinator", "trainer": "services.trainer", "rollout": "services.rollout",
           "reward": "services.reward", "reference": "services.reference"}
SECTION = {"coordinator": "run", "trainer": "actor", "rollout": "rollout", "reward": "reward",
           "reference": "reference"}


def _serve(role: str, config, *args, env=None) -> tuple[int, str]:
    result = subprocess.run([sys.executable, "-m", MODULES[role], "--config", str(config), "--port", "0", *args],
                            cwd=REPO, capture_output=True, text=True, timeout=180,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    return result.returncode, result.stdout + result.stderr


@pytest.mark.parametrize("role", list(MODULES))
def test_a_service_given_a_config_with_an_unknown_key_exits_at_once_naming_it(tmp_path, role):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"server": {"bogus_key": 1}}))
    code, out = _serve(role, bad)
    assert code != 0 and "server.bogus_key: unknown key" in out and str(bad) in out
    # at once: before it loads a model or binds a port (the config is read first)
    assert "listening on" not in out and "loaded" not in out.lower(), out[-2000:]


@pytest.mark.parametrize("text,expected", [
    ("rollout:\n  n: 4\n   max_tokens: 6\n", "line 3"),                      # bad indentation
    ("rollout: {n: 4\n", "line 2"),                                          # unclosed flow mapping
    ("- rollout\n- reward\n", "top level must be a mapping"),
    ("rollout:\n  n: many\n", "rollout.n: Input should be a valid integer"),
    ("rollout:\n  temperature: -1\n", "rollout.temperature"),
    ("rollout:\n  stop: ['']\n", "rollout.stop"),
    ("server:\n  grace_seconds: -1\n", "server.grace_seconds"),
])
def test_a_malformed_config_file_fails_naming_the_file_and_the_line_or_key(tmp_path, text, expected):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    code, out = _serve("rollout", bad)
    assert code != 0 and expected in out and str(bad) in out, out[-2000:]
    assert "Traceback" not in out


def test_bad_values_from_the_environment_and_flags_fail_naming_the_key(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("reward: {num_workers: 1}\n")
    code, out = _serve("reward", good, env={"MESHRL_REWARD__NUM_WORKERS": "zero"})
    assert code != 0 and "reward.num_workers" in out
    code, out = _serve("reward", good, "--reward.function_timeout_s", "-5")
    assert code != 0 and "reward.function_timeout_s" in out
    code, out = _serve("reward", tmp_path / "missing.yaml")
    assert code != 0 and "missing.yaml" in out and "does not exist" in out


@pytest.mark.parametrize("lines,expected", [
    (['{"prompt": "1+1=", "answer": "2"}', '{"prompt": "2+2=", "answer": "4"', '{"prompt": "x"}'],
     "line 2: invalid JSON"),
    (['{"prompt": "1+1=", "answer": "2"}', '[1, 2]'], "line 2: a row must be a JSON object"),
    (['{"prompt": "1+1=", "answer": "2"}', '{"question": "2+2=", "answer": "4"}'], "row 1: missing key 'prompt'"),
    (['{"prompt": "1+1="}'], "row 0: missing key 'answer'"),
    (['{"prompt": 12, "answer": "2"}'], "'prompt' must be a string or a list of chat messages"),
    ([], "no rows"),
])
def test_a_malformed_dataset_fails_start_run_naming_the_file_and_the_line(arith_model_path, tmp_path, lines,
                                                                          expected):
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(lines) + ("\n" if lines else ""))
    config = {"model": {"path": arith_model_path}, "data": {"train_files": [str(data)]}, "rollout": {"n": 2},
              "run": {"run_dir": str(tmp_path / "runs")}}

    async def main():
        server, port, engine = await start_coordinator(load_config(CoordinatorSettings, data={}), "127.0.0.1:0")
        client = Client(f"127.0.0.1:{port}")
        try:
            with pytest.raises(grpc.RpcError) as err:
                await asyncio.to_thread(client.start_run, yaml.safe_dump(config))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert expected in err.value.details() and (str(data) in err.value.details() or not lines)
            assert err.value.details().startswith("data.train_files: ")     # the user's key first, then the file
            assert await asyncio.to_thread(client.list_runs) == []          # nothing half-started
        finally:
            client.close()
            await engine.close()
            await server.stop(0)

    asyncio.run(main())


def test_a_dataset_path_that_does_not_exist_is_named(arith_model_path, tmp_path):
    config = {"model": {"path": arith_model_path}, "data": {"train_files": [TRAIN, str(tmp_path / "nope.jsonl")]},
              "rollout": {"n": 2}}

    async def main():
        server, port, engine = await start_coordinator(load_config(CoordinatorSettings, data={}), "127.0.0.1:0")
        client = Client(f"127.0.0.1:{port}")
        try:
            with pytest.raises(grpc.RpcError) as err:
                await asyncio.to_thread(client.start_run, yaml.safe_dump(config))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "nope.jsonl" in err.value.details() and "does not exist" in err.value.details()
        finally:
            client.close()
            await engine.close()
            await server.stop(0)

    asyncio.run(main())
