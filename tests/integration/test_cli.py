"""The `meshrl` command: `up` runs a whole mesh of processes and leaves none behind; `plot` writes a PNG."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _meshrl(*args, timeout=600, env=None):
    return subprocess.run([sys.executable, "-m", "coordinator.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def _service_processes(marker: str) -> list[str]:
    """Service processes whose command line carries `marker` (the run dir every child is given)."""
    # -ww: ps cuts lines at $COLUMNS (pytest sets it), which cut the marker off every line
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if marker in line
            and ("-m services." in line or "-m coordinator --config" in line)]


@pytest.mark.slow
def test_meshrl_up_runs_every_service_as_a_process_and_prints_accuracy_before_and_after(arith_model_path,
                                                                                       tmp_path):
    result = _meshrl("up", "examples/arith/grpo.yaml", "--run-dir", str(tmp_path), "--model.path", arith_model_path,
                     "--run.num_steps", "6", "--data.heldout_size", "50", "--data.rollout_batch_size", "8",
                     "--actor.lr", "1e-4", "--run.eval_every", "0")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert any(line.startswith("step   1/6") for line in lines)
    assert any(line.startswith("step   6/6") for line in lines)
    assert "held-out accuracy before" in lines[-1] and "-> after" in lines[-1]
    run_dirs = [p for p in tmp_path.iterdir() if p.name.startswith("arith-grpo")]
    assert len(run_dirs) == 1
    records = [json.loads(line) for line in (run_dirs[0] / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "reward_mean" in r] == [1, 2, 3, 4, 5, 6]
    summary = json.loads((run_dirs[0] / "summary.json").read_text())
    assert summary["steps"] == 6
    # the quick variant of the demo: learning does not make held-out accuracy worse
    assert summary["heldout_accuracy_after"] >= summary["heldout_accuracy_before"]
    assert any((run_dirs[0] / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dirs[0] / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # every child process is gone
    assert _service_processes(str(tmp_path)) == []


def test_meshrl_up_rejects_a_bad_config_before_starting_anything(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: {n: 0}\n")
    result = _meshrl("up", str(bad), timeout=120)
    assert result.returncode == 2
    assert result.stderr == f"meshrl up: {bad}: rollout.n: Input should be greater than or equal to 1\n"


def test_meshrl_plot_writes_a_valid_png_of_non_trivial_size(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with (run_dir / "metrics.jsonl").open("w") as f:
        f.write(json.dumps({"step": 0, "heldout_accuracy": 0.3}) + "\n")
        for step in range(1, 6):
            f.write(json.dumps({"step": step, "reward_mean": 0.1 * step, "accuracy": 0.1 * step, "kl": 0.01 * step,
                                "actor/entropy": 1.0 - 0.1 * step, "response_length_mean": 3.0,
                                "time/generate": 0.2, "time/train": 0.1, "time/weight_sync": 0.01}) + "\n")
    out = tmp_path / "plot.png"
    result = _meshrl("plot", str(run_dir), "--out", str(out), timeout=120)
    assert result.returncode == 0, result.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    import struct
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 800 and height >= 500


@pytest.mark.slow
def test_meshrl_up_stopped_by_sigterm_leaves_no_service_behind_even_without_setpriv(arith_model_path, tmp_path):
    """SIGTERM (a scheduler's stop, `timeout`) stops every service: without setpriv on PATH no kernel death signal
    reaches the children, so `meshrl up` itself must stop them (an orphaned trainer keeps its GPU memory)."""
    import signal
    import time

    bin_dir = tmp_path / "bin"          # PATH without setpriv: only this Python
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "up", "examples/arith/grpo.yaml",
                             "--run-dir", str(tmp_path), "--model.path", arith_model_path, "--run.num_steps", "500",
                             "--run.eval_every", "0", "--data.heldout_size", "20"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PATH": str(bin_dir)})
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("step   2/500"):
                break
        assert len(_service_processes(str(tmp_path))) >= 5, "".join(seen)[-3000:]
        assert not any("setpriv" in p for p in _service_processes(str(tmp_path)))
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        deadline = time.time() + 15
        while _service_processes(str(tmp_path)) and time.time() < deadline:
            time.sleep(0.5)
        assert _service_processes(str(tmp_path)) == []
    finally:
        if proc.poll() is None:
            proc.kill()
