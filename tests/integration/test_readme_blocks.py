"""The README's runnable blocks run as written: a fenced block right after a `<!-- test: readme -->` line is run
here, in order, from the repository root (bash blocks with `meshrl` on PATH, python blocks with this checkout on
PYTHONPATH): the long-lived mesh, a run on it, the script that drives a run, the mesh's stop."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordinator import mesh_address

REPO = Path(__file__).resolve().parents[2]
RUNNABLE = re.compile(r"^<!-- test: readme -->\n```(?P<lang>bash|python)\n(?P<code>.*?)^```", re.S | re.M)


def readme_blocks() -> list[tuple[str, str]]:
    return [(m["lang"], m["code"]) for m in RUNNABLE.finditer((REPO / "README.md").read_text())]


def test_the_readme_marks_the_mesh_the_script_and_the_stop_as_runnable():
    blocks = readme_blocks()
    assert [lang for lang, _ in blocks] == ["bash", "python", "bash"]
    mesh, script, stop = (code for _, code in blocks)
    assert "meshrl mesh examples/arith/grpo.yaml --detach" in mesh and "meshrl run examples/arith/grpo.yaml" in mesh
    assert "Client()" in script and "start_run" in script
    assert "meshrl mesh --stop" in stop


def _env(tmp_path: Path) -> dict[str, str]:
    """`meshrl` is this checkout's CLI; the mesh's record, logs and runs go under tmp_path."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "meshrl"
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m coordinator.cli \"$@\"\n")
    shim.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "MESHRL_COORDINATOR"}
    return {**env, "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}", "XDG_CACHE_HOME": str(tmp_path / "cache"),
            "MESHRL_RUN__RUN_DIR": str(tmp_path / "runs"), "OMP_NUM_THREADS": "1", "COLUMNS": "200",
            "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "protos")])}


def _run(lang: str, code: str, env: dict[str, str]) -> str:
    cmd = ["bash", "-e", "-o", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
    assert out.returncode == 0, f"README {lang} block failed ({out.returncode}):\n{code}\n{out.stdout}\n{out.stderr}"
    return out.stdout


def _stop_leftover(env: dict[str, str]) -> None:
    """A mesh the blocks left running (a failed assertion before the stop block) is stopped here."""
    path = Path(env["XDG_CACHE_HOME"]) / "meshrl" / "mesh.json"
    if not path.exists():
        return
    pid = json.loads(path.read_text())["pid"]
    if mesh_address.alive(pid):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while mesh_address.alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)


@pytest.mark.slow
def test_the_readme_mesh_and_script_blocks_run_as_written(tmp_path):
    env = _env(tmp_path)
    (mesh_lang, mesh), (script_lang, script), (stop_lang, stop) = readme_blocks()
    record = Path(env["XDG_CACHE_HOME"]) / "meshrl" / "mesh.json"
    try:
        out = _run(mesh_lang, mesh, env)
        assert "COMPLETED after 10 steps" in out and "held-out accuracy before" in out, out
        pid, training = (json.loads(record.read_text())[key] for key in ("pid", "training"))
        # `--detach` says where the training API is, as the foreground mesh does (docs/training_api.md).
        assert f"meshrl mesh: training API at {training} " in out, out
        # `meshrl status` and `meshrl services` found the mesh through its record: the run and the replicas.
        assert re.search(r"COMPLETED.*10/10", out), out
        for role in ("rollout", "reward", "reference"):
            assert re.search(rf"^\W*{role}\W+127\.0\.0\.1:\d+\W+yes", out, re.M), out

        out = _run(script_lang, script, env)
        lines = out.strip().splitlines()
        assert lines[-1].endswith(" COMPLETED"), out
        steps = [int(line.split()[0]) for line in lines[:-1]]
        assert steps[0] == 0 and max(steps) == 10, out       # held-out before (step 0), steps 1..10, after
        assert len(list((tmp_path / "runs").glob("arith-grpo-*/metrics.jsonl"))) == 2

        out = _run(stop_lang, stop, env)
        assert "stopped the mesh" in out
        assert not record.exists() and not mesh_address.alive(pid)
    finally:
        _stop_leftover(env)
