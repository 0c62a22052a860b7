"""`meshrl up` with an `env:` section: it starts the env replicas, hands their addresses to the rollout replicas
(their env pool), prints them with the others, and restarts one that is killed on its address."""

import json
import os
import re
import signal
import subprocess
import sys

import grpc
import pytest

from meshrl.v1 import common_pb2, env_pb2, env_pb2_grpc, rollout_pb2_grpc
from tests.integration.test_up_supervision import REPO, _cli, _lines, _pid_listening_on, _read_to_end, _read_until

# More steps than the test waits for; the run is paused after its first step, so it cannot end before the Ctrl-C
# however slow the machine.
NUM_STEPS = 1000


def _calculate(address: str, expression: str) -> str:
    with grpc.insecure_channel(address) as channel:
        response = env_pb2_grpc.EnvStub(channel).CallTools(env_pb2.CallToolsRequest(calls=[
            env_pb2.ToolCall(id="1", name="calculator", arguments_json=json.dumps({"expression": expression}))]),
            timeout=60)
    [result] = response.results
    assert not result.error, result.error
    return result.content


def _rollout_settings(address: str) -> dict:
    with grpc.insecure_channel(address) as channel:
        info = rollout_pb2_grpc.RolloutStub(channel).GetInfo(common_pb2.GetInfoRequest(), timeout=60)
    return json.loads(info.details["settings"])


def _interruptible(args: list[str], **kwargs) -> subprocess.Popen:
    """Popen whose child takes a Ctrl-C as a terminal's would. An ignored SIGINT is inherited across exec: when
    whoever started pytest ignored it (a background job of a shell without job control, `nohup ... &`), `meshrl up`
    would ignore the test's SIGINT and run on. A Python handler is reset to the default in the child instead."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(args, **kwargs)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)


@pytest.mark.slow
def test_meshrl_up_starts_env_replicas_for_the_rollout_replicas_and_restarts_a_killed_one(arith_model_path, tmp_path):
    proc = _interruptible([sys.executable, "-m", "coordinator.cli", "up", "examples/arith/grpo.yaml",
                           "--run-dir", str(tmp_path), "--model.path", arith_model_path,
                           "--env.replicas", "2", "--rollout.replicas", "1", "--run.num_steps", str(NUM_STEPS),
                           "--run.eval_every", "0", "--data.heldout_size", "8", "--data.rollout_batch_size", "8"],
                          cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen: list[str] = []
    try:
        lines = _lines(proc)
        addresses = json.loads(_read_until(lines, seen, "mesh up: ")[len("mesh up: "):].rsplit(" (logs in", 1)[0])
        env = addresses["env"]
        assert len(env) == 2 and len(set(env)) == 2
        assert [_calculate(a, "987 * 654") for a in env] == ["645498", "645498"]
        # the rollout replica's env pool is the replicas `meshrl up` started (and waits for one that restarts)
        settings = _rollout_settings(addresses["rollout"][0])
        assert settings["env"]["servers"] == env and settings["env"]["rejoin_wait_s"] > 0
        run_id = _read_until(lines, seen, "run ").split()[1]
        _read_until(lines, seen, f"step   1/{NUM_STEPS}")
        _cli("pause", run_id, addresses)
        os.kill(_pid_listening_on(proc.pid, env[1]), signal.SIGKILL)
        died = _read_until(lines, seen, "meshrl up: env-1 exited")
        assert re.fullmatch(r"meshrl up: env-1 exited with code -9 during the run: killed by SIGKILL \(log: .+/"
                            r"env-1\.log\); restarting it in 1s \(restart 1 of 3\)", died), died
        back = _read_until(lines, seen, "meshrl up: env-1 restarted")
        assert back.startswith(f"meshrl up: env-1 restarted and serving on {env[1]} (restart 1 of 3;"), back
        assert _calculate(env[1], "12 * 34") == "408"
        proc.send_signal(signal.SIGINT)           # as a user's Ctrl-C: `meshrl up` stops every service
        _read_to_end(lines, seen, 120)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = "\n".join(seen)
    assert proc.returncode == 130, out[-4000:]
    assert "meshrl up: rollout-" not in out and "meshrl up: env-0" not in out, out[-4000:]
