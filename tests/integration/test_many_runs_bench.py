"""bench/many_runs.py on tiny settings (CPU, the arith model): two 1-step LoRA runs at once and one after another, on
an in-process mesh and on `meshrl mesh` processes driven through the coordinator's run API. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import pytest

from bench import many_runs as bench

REPO = Path(__file__).resolve().parents[2]


def _processes(marker: str) -> list[str]:
    """`pid args` of every process whose command line names `marker` (the bench's work dir: each service's recipe)."""
    # -ww: ps cuts lines at $COLUMNS (pytest sets it), which cut the marker off
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line.strip() for line in out.splitlines() if marker in line]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["processes", "inprocess"])
def test_the_many_runs_bench_completes_both_phases_and_leaves_no_service_running(tmp_path, monkeypatch, mesh):
    work = tmp_path / "tmp"
    work.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(work))        # the bench's TemporaryDirectory: the marker
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))   # a user's mesh file would be here
    monkeypatch.chdir(REPO)
    during: list[list[str]] = []
    timed = bench.timed_phases

    async def seen_then_timed(runs, config, args):
        during.append(_processes(str(work)))
        return await timed(runs, config, args)

    monkeypatch.setattr(bench, "timed_phases", seen_then_timed)
    out = tmp_path / "many_runs.json"
    wait = ["--merge-wait-passes", "1.0"] if mesh == "processes" else []     # the mesh's trainer takes it
    assert bench.main(["--mesh", mesh, "--runs", "2", "--steps", "1", "--out", str(out), *wait]) == 0
    result = json.loads(out.read_text())

    assert result["mesh"] == mesh and result["samples_per_step"] == 16 * 8
    assert result["merge_wait_passes"] == (1.0 if wait else 0.5)
    assert [p["mode"] for p in result["phases"]] == ["sequential", "concurrent", "concurrent", "sequential"]
    for p in result["phases"]:
        assert [(r["state"], r["steps"]) for r in p["runs"]] == [("COMPLETED", 1)] * 2, p["runs"]
        assert p["samples"] == 2 * 1 * 16 * 8
        assert {"time/step", "time/generate", "time/train", "time/weight_sync"} <= set(p["step_time_means"])
    assert result["ratio_concurrent_over_sequential"] > 0
    # processes: `meshrl mesh` and each service its own process while the phases ran; in process, none
    roles = sorted(line.split(" -m ", 1)[1].split()[0] for line in during[0] if " -m " in line)
    assert roles == (["coordinator", "coordinator.cli", "services.reward", "services.rollout", "services.rollout",
                      "services.trainer", "services.training_api"] if mesh == "processes" else []), during[0]
    # every process is gone, and the mesh was recorded in the bench's own mesh file, not the user's
    assert _processes(str(work)) == []
    assert not (tmp_path / "user-cache" / "meshrl").exists()


@pytest.mark.slow
def test_a_process_mesh_is_stopped_when_the_bench_fails_midway(tmp_path, monkeypatch):
    work = tmp_path / "tmp"
    work.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(work))
    monkeypatch.chdir(REPO)
    during: list[list[str]] = []

    async def fail(runs, config, args):
        during.append(_processes(str(work)))
        raise RuntimeError("a phase failed")

    monkeypatch.setattr(bench, "timed_phases", fail)
    with pytest.raises(RuntimeError, match="a phase failed"):
        bench.main(["--mesh", "processes", "--runs", "2", "--steps", "1", "--out", str(tmp_path / "x.json")])
    assert len(during[0]) == 7, during[0]           # the mesh was up: itself and its six services
    assert _processes(str(work)) == []
