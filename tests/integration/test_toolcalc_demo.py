"""The toolcalc demo through the whole mesh (examples/toolcalc): `meshrl up` with an env replica, tool-calling
episodes played in the rollout replica, and GRPO raising held-out accuracy by at least 25 points."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_grpo_through_the_mesh_teaches_the_tiny_model_to_call_the_calculator(tmp_path):
    # 20 of the recipe's 40 steps: held-out accuracy is past 80% at step 20 in the recorded runs (README).
    result = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "up", "examples/toolcalc/grpo.yaml", "--run-dir", str(tmp_path),
         "--run.num_steps", "20", "--data.heldout_size", "50", "--run.eval_every", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.name.startswith("toolcalc-grpo")]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["heldout_accuracy_after"] - summary["heldout_accuracy_before"] >= 0.25, summary
    steps = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "reward_mean" in r]
    assert len(steps) == 20
    calls = [r["tool_calls_per_episode"] for r in steps]
    assert sum(calls[-5:]) / 5 > sum(calls[:5]) / 5 + 0.1
    assert all(r["turns_per_episode"] == pytest.approx(1 + r["tool_calls_per_episode"], abs=0.05) for r in steps)
    assert all(0.0 <= r["tool_error_rate"] <= 1.0 for r in steps)
    assert (run_dir / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
