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

import psutil
import pytest

from tests.integration.test_up_supervision import _lines, _read_to_end, _read_until

REPO = Path(__file__).resolve().parents[2]
NUM_STEPS = 6


def _up(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "coordinator.cli", *args], cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _run_to_end(proc: subprocess.Popen, seen: list[str], lines=None) -> int:
    try:
        _read_to_end(lines or _lines(proc), seen, 600)
        return proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _args(model: str, tmp_path: Path, redis_url: str) -> list[str]:
    return ["up", "examples/arith/grpo.yaml", "--run-dir", str(tmp_path), "--model.path", model,
            "--run.num_steps", str(NUM_STEPS), "--run.eval_every", "0", "--data.heldout_size", "4",
            "--data.rollout_batch_size", "4", "--rollout.replicas", "1", "--run.redis_url", redis_url,
            "--run.redis_prefix", f"meshrl-sigterm-{uuid.uuid4().hex[:8]}"]


def _interrupt(args: list[str], send) -> tuple[str, int, str]:
    """`meshrl up` stopped by send(proc) after step 2: -> (run id, the step it stopped at, the resume command),
    once it exited with the signal's code, said so last, checkpointed that step and left no process behind."""
    # A session of its own, as a shell's foreground job: a Ctrl-C is SIGINT to its whole process group.
    proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", *args], cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen: list[str] = []
    lines = _lines(proc)
    try:
        run_id = _read_until(lines, seen, "run ").split()[1]
        _read_until(lines, seen, f"step   2/{NUM_STEPS}")
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 4, [c.cmdline() for c in children]     # trainer, reward, rollout, coordinator
        signum = send(proc)
    finally:
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
    assert 2 <= stopped_at < NUM_STEPS and checkpoint.name == f"step_{stopped_at}", line
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
    run_id, stopped_at, command = _interrupt(_args(arith_model_path, tmp_path, redis_url), _sigterm)

    resumed, again = _up(shlex.split(command)[1:]), []
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
    _interrupt(_args(arith_model_path, tmp_path, redis_url), _ctrl_c)
