"""`meshrl up` stopped by SIGTERM behaves as on Ctrl-C: the step in flight finishes, the run is paused and
checkpointed, every child process ends, and the printed `meshrl up --resume RUN_ID ...` continues the run at the
next step until it completes, each step recorded once."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import asyncio
import time

import psutil
import pytest
import yaml

from coordinator.runapi.store import RedisStore
from tests.integration.test_up_env import _interruptible
from tests.integration.test_up_supervision import _lines, _read_to_end, _read_until

REPO = Path(__file__).resolve().parents[2]
NUM_STEPS = 6
# Holds a step in flight until the test lets it go (its docstring): a step of this recipe takes 0.1 s, so without it
# a loaded machine can finish the run between the test reading "step 2" and its signal landing.
GATED_REWARD = Path(__file__).with_name("gated_reward.py")


def _env(tmp_path: Path) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MESHRL_TEST_GATE": str(tmp_path / "gate")}


def _up(args: list[str], tmp_path: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "coordinator.cli", *args], cwd=REPO, env=_env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _run_to_end(proc: subprocess.Popen, seen: list[str], lines=None) -> int:
    try:
        _read_to_end(lines or _lines(proc), seen, 600)
        return proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _args(model: str, tmp_path: Path, redis_url: str, prefix: str) -> list[str]:
    """The arith recipe without its held-out set (step 1's rewards are then the run's first reward calls) and with
    the gated reward."""
    recipe = yaml.safe_load((REPO / "examples/arith/grpo.yaml").read_text())
    del recipe["data"]["heldout_files"]
    # A held call must outlast the test's own waits (300 s a line), so a lost signal fails on what the test waited for.
    recipe["reward"] = {"custom_function": {"path": str(GATED_REWARD)}, "function_timeout_s": 900}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return ["up", str(path), "--run-dir", str(tmp_path), "--model.path", model,
            "--run.num_steps", str(NUM_STEPS), "--run.eval_every", "0",
            "--data.rollout_batch_size", "4", "--rollout.replicas", "1", "--run.redis_url", redis_url,
            "--run.redis_prefix", prefix]


def _wait_for(check, what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"waited {timeout:g}s for {what}"
        time.sleep(0.05)


def _pause_asked(redis_url: str, prefix: str, run_id: str) -> bool:
    """The run's record (in Redis, read by the coordinator's own store) carries the pause command."""
    async def read():
        store = RedisStore(redis_url, prefix)
        try:
            return await store.get(run_id)
        finally:
            await store.close()
    record = asyncio.run(read())
    return record is not None and record.command == "pause"


def _interrupt(tmp_path: Path, model: str, redis_url: str, send) -> tuple[str, int, str]:
    """`meshrl up` stopped by send(proc) while step 1 is in flight: -> (run id, the step it stopped at, the resume
    command), once it exited with the signal's code, said so last, checkpointed that step and left no process
    behind. Step 1 is held in flight (gated_reward.py: no held-out set, so its rewards are the run's first calls)
    until the run's pause was asked for, whatever the machine's load."""
    prefix = f"meshrl-sigterm-{uuid.uuid4().hex[:8]}"
    gate = tmp_path / "gate"
    gate.mkdir()
    (gate / "hold").touch()
    # A session of its own, as a shell's foreground job: a Ctrl-C is SIGINT to its whole process group.
    # Its SIGINT at the default, as a shell sets it for a foreground job, also when pytest was started with it ignored.
    proc = _interruptible([sys.executable, "-m", "coordinator.cli", *_args(model, tmp_path, redis_url, prefix)],
                          cwd=REPO, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, start_new_session=True)
    seen: list[str] = []
    lines = _lines(proc)
    try:
        run_id = _read_until(lines, seen, "run ").split()[1]
        _wait_for((gate / "held").exists, "step 1's rewards held at the gate")
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 4, [c.cmdline() for c in children]     # trainer, reward, rollout, coordinator
        signum = send(proc)
        _read_until(lines, seen, f"meshrl up: stopping: run {run_id}")
        _wait_for(lambda: _pause_asked(redis_url, prefix, run_id), "the pause command in the run's record")
    finally:
        (gate / "go").touch()
        code = _run_to_end(proc, seen, lines)
    out = "\n".join(seen)
    assert code == 128 + signum, out[-4000:]
    assert seen[-1] == "meshrl up: interrupted", out[-4000:]
    line = next((x for x in seen if x.startswith(f"meshrl up: run {run_id} interrupted")), None)
    assert line is not None, out[-4000:]
    m = re.fullmatch(rf"meshrl up: run {run_id} interrupted at step (\d+)/{NUM_STEPS} \(checkpoint (\S+)\); "
                     rf"resume it with: (meshrl up --resume {run_id} .+)", line)
    assert m is not None, line
    stopped_at, checkpoint = int(m.group(1)), Path(m.group(2))
    # The step in flight when the signal came finished and was checkpointed; nothing of the mesh is left running.
    assert stopped_at == 1 and checkpoint.name == "step_1", line
    assert (checkpoint / "manifest.json").exists()
    assert [c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE] == []
    return run_id, stopped_at, m.group(3)


def _sigterm(proc) -> int:
    proc.send_signal(signal.SIGTERM)
    return signal.SIGTERM


def _ctrl_c(proc) -> int:
    os.killpg(proc.pid, signal.SIGINT)        # what a terminal sends its foreground job: every process in it
    return signal.SIGINT


@pytest.mark.slow
@pytest.mark.redis
def test_sigterm_finishes_the_step_prints_the_resume_command_and_resume_continues_at_the_next_step(
        arith_model_path, tmp_path, redis_url):
    run_id, stopped_at, command = _interrupt(tmp_path, arith_model_path, redis_url, _sigterm)

    resumed, again = _up(shlex.split(command)[1:], tmp_path), []
    code = _run_to_end(resumed, again)
    out = "\n".join(again)
    assert code == 0, out[-4000:]
    assert f"run {run_id} resumed at step {stopped_at}/{NUM_STEPS}" in again, out[-4000:]
    printed = [int(x.split()[1].split("/")[0]) for x in again if x.startswith("step ")]
    assert printed == list(range(stopped_at + 1, NUM_STEPS + 1)), out[-4000:]
    records = [json.loads(x) for x in (tmp_path / run_id / "metrics.jsonl").read_text().splitlines()]
    assert sorted(int(r["step"]) for r in records if "reward_mean" in r) == list(range(1, NUM_STEPS + 1))


@pytest.mark.slow
@pytest.mark.redis
def test_a_terminals_ctrl_c_reaches_meshrl_up_only_and_the_step_in_flight_still_finishes(
        arith_model_path, tmp_path, redis_url):
    _interrupt(tmp_path, arith_model_path, redis_url, _ctrl_c)
