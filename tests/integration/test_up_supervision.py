"""`meshrl up` supervises its children: a rollout replica killed with SIGKILL mid-run is restarted on its port,
rejoins at the current weight version, and the run completes every step."""

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.reliability.test_security import _children, _listening

REPO = Path(__file__).resolve().parents[2]
# Steps after the restart too: the restarted replica rejoins and takes the last step's update.
NUM_STEPS = 150


def _lines(proc: subprocess.Popen) -> queue.Queue:
    """`meshrl up`'s output, line by line, read by a thread (None at its end)."""
    out: queue.Queue = queue.Queue()

    def pump():
        for line in proc.stdout:
            out.put(line.rstrip("\n"))
        out.put(None)
    threading.Thread(target=pump, daemon=True).start()
    return out


def _next_line(lines: queue.Queue, seen: list[str], timeout: float, waiting_for: str) -> str | None:
    """The next line of `meshrl up` (None at its end); a silence of `timeout` seconds fails with what it said."""
    try:
        return lines.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError(f"meshrl up said nothing for {timeout:g}s while the test waited for {waiting_for}; "
                             "its last lines:\n" + "\n".join(seen[-40:])) from None


def _read_until(lines: queue.Queue, seen: list[str], prefix: str) -> str:
    while True:
        line = _next_line(lines, seen, 300, repr(prefix))
        if line is None:
            lines.put(None)         # the end stays readable: a caller's _read_to_end returns instead of waiting
        assert line is not None, "meshrl up ended early:\n" + "\n".join(seen[-40:])
        seen.append(line)
        if line.startswith(prefix):
            return line


def _read_to_end(lines: queue.Queue, seen: list[str], timeout: float) -> None:
    while (line := _next_line(lines, seen, timeout, "its end")) is not None:
        seen.append(line)


def _cli(verb: str, run_id: str, addresses: dict) -> None:
    coordinator = addresses["coordinator"]
    coordinator = coordinator[0] if isinstance(coordinator, list) else coordinator
    subprocess.run([sys.executable, "-m", "coordinator.cli", verb, run_id, "--coordinator", coordinator],
                   cwd=REPO, check=True, capture_output=True, timeout=120)


def _pid_listening_on(parent: int, address: str) -> int:
    for kid in _children(parent):
        try:
            if address in _listening(kid):
                return kid
        except OSError:
            continue
    raise AssertionError(f"no child of {parent} listens on {address}")


@pytest.mark.slow
def test_meshrl_up_restarts_a_killed_rollout_replica_and_the_run_completes_every_step(arith_model_path, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "up", "examples/arith/grpo.yaml",
                             "--run-dir", str(tmp_path), "--model.path", arith_model_path,
                             "--rollout.replicas", "2", "--run.num_steps", str(NUM_STEPS), "--run.eval_every", "0",
                             "--run.refresh_interval_s", "0.5", "--data.heldout_size", "8",
                             "--data.rollout_batch_size", "8"],
                            cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []
    try:
        lines = _lines(proc)
        addresses = json.loads(_read_until(lines, seen, "mesh up: ")[len("mesh up: "):].rsplit(" (logs in", 1)[0])
        victim = addresses["rollout"][1]
        run_id = _read_until(lines, seen, "run ").split()[1]
        _read_until(lines, seen, f"step   1/{NUM_STEPS}")
        # Paused while the replica dies and comes back, so the run cannot end before the restart (150 steps once
        # nearly did on a loaded machine); resumed once the supervisor says it serves again.
        _cli("pause", run_id, addresses)
        os.kill(_pid_listening_on(proc.pid, victim), signal.SIGKILL)
        _read_until(lines, seen, "meshrl up: rollout-1 restarted and serving")
        _cli("resume", run_id, addresses)
        _read_to_end(lines, seen, 600)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = "\n".join(seen)
    assert proc.returncode == 0, out[-4000:]
    died = next(line for line in seen if line.startswith("meshrl up: rollout-1 exited with code -9 during the run"))
    assert re.fullmatch(r"meshrl up: rollout-1 exited with code -9 during the run: killed by SIGKILL \(log: (.+)/"
                        r"rollout-1\.log\); restarting it in 1s \(restart 1 of 3\)", died), died
    log_dir = Path(died.rsplit("(log: ", 1)[1].split(")", 1)[0]).parent
    restart_log = log_dir / "rollout-1.restart-1.log"
    assert f"meshrl up: rollout-1 restarted and serving on {victim} (restart 1 of 3; log: {restart_log})" in seen, out
    # It rejoined: the coordinator brought it to the run's weights, and it had the last step's update.
    assert f"weights version {NUM_STEPS} applied" in restart_log.read_text()
    assert any(line.startswith(f"run ") and f"COMPLETED after {NUM_STEPS} steps" in line for line in seen), out
    run_dir = next(p for p in tmp_path.iterdir() if p.name.startswith("arith-grpo"))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "reward_mean" in r] == list(range(1, NUM_STEPS + 1))
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == NUM_STEPS
