"""Runs the first steps of a recipe through `meshrl up` (every service its own process), or as a run on a `meshrl
mesh` that several recipes share, as the learning tests of the example recipes do: the run's folder and its
summary.json."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import yaml

REPO = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "protos")]), **extra}


def _meshrl(*args: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "coordinator.cli", *args], cwd=REPO, capture_output=True,
                            text=True, timeout=timeout, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def up_prefix(recipe: str, run_dir: Path, steps: int, *, timeout: float) -> tuple[Path, dict]:
    """`meshrl up RECIPE` for its first `steps` steps (never more than the recipe's own), held-out evaluation only
    before and after; asserts it succeeded and wrote one run. Returns that run's folder and summary."""
    assert yaml.safe_load((REPO / recipe).read_text())["run"]["num_steps"] >= steps   # a prefix of the recipe
    _meshrl("up", recipe, "--run-dir", str(run_dir), "--run.num_steps", str(steps), "--run.eval_every", "0",
            env=_env(), timeout=timeout)
    return _one_run(run_dir, steps)


@contextlib.contextmanager
def shared_mesh(recipe: str, work: Path) -> Iterator[dict[str, str]]:
    """`meshrl mesh RECIPE --detach` (every service its own process; its record, logs and runs under `work`), for
    the runs of several recipes that differ from it only in per-run keys; yields the environment `meshrl run`
    finds it with. Stopped at exit."""
    env = _env(XDG_CACHE_HOME=str(work / "cache"))
    env.pop("MESHRL_COORDINATOR", None)
    try:
        _meshrl("mesh", recipe, "--detach", "--run-dir", str(work / "runs"), env=env, timeout=600)
        yield env
    finally:
        if (work / "cache" / "meshrl" / "mesh.json").exists():
            _meshrl("mesh", "--stop", env=env, timeout=300)


def run_prefix(recipe: str, run_dir: Path, steps: int, *, env: dict[str, str], timeout: float) -> tuple[Path, dict]:
    """up_prefix's run as a run of the mesh `env` finds (shared_mesh): `meshrl run RECIPE`, the run's folder under
    `run_dir`. Returns that run's folder and summary."""
    assert yaml.safe_load((REPO / recipe).read_text())["run"]["num_steps"] >= steps   # a prefix of the recipe
    _meshrl("run", recipe, "--run.run_dir", str(run_dir), "--run.num_steps", str(steps), "--run.eval_every", "0",
            env=env, timeout=timeout)
    return _one_run(run_dir, steps)


def _one_run(run_dir: Path, steps: int) -> tuple[Path, dict]:
    runs = [p for p in run_dir.iterdir() if (p / "summary.json").exists()]
    assert len(runs) == 1, runs
    summary = json.loads((runs[0] / "summary.json").read_text())
    assert summary["steps"] == steps
    return runs[0], summary
