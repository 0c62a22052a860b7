"""Runs the first steps of a recipe through `meshrl up` (every service its own process), as the learning tests of
the example recipes do: the run's folder and its summary.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def up_prefix(recipe: str, run_dir: Path, steps: int, *, timeout: float) -> tuple[Path, dict]:
    """`meshrl up RECIPE` for its first `steps` steps (never more than the recipe's own), held-out evaluation only
    before and after; asserts it succeeded and wrote one run. Returns that run's folder and summary."""
    assert yaml.safe_load((REPO / recipe).read_text())["run"]["num_steps"] >= steps   # a prefix of the recipe
    result = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "up", recipe, "--run-dir", str(run_dir),
         "--run.num_steps", str(steps), "--run.eval_every", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
             "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "protos")])})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    runs = [p for p in run_dir.iterdir() if (p / "summary.json").exists()]
    assert len(runs) == 1, runs
    summary = json.loads((runs[0] / "summary.json").read_text())
    assert summary["steps"] == steps
    return runs[0], summary
