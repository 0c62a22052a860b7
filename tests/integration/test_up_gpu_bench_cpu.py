"""bench/up_gpu.py end to end on the CPU: `meshrl up examples/arith/grpo.yaml` with the recipe alone and with the
tuned flags, two steps each, into one JSON."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_up_gpu_bench_runs_the_arith_recipe_both_ways_on_cpu(tmp_path):
    out = tmp_path / "up.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=os.environ.get("PATH", ""))
    got = subprocess.run([sys.executable, "bench/up_gpu.py", "--recipe", "examples/arith/grpo.yaml",
                          "--shape", "arith", "--steps", "2", "--warmup", "1", "--timeout-per-run", "150",
                          "--work-dir", str(tmp_path / "work"), "--out", str(out)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["runs"]) == {"defaults", "tuned"}
    assert result["settings"]["batch"] == 16 * 8 and result["settings"]["tuned_flags"][0] == "--rollout.max_batch_size"
    for name, run in result["runs"].items():
        assert run["rc"] == 0 and not run["timed_out"], name
        assert run["num_steps"] == 2 and run["steady_steps"] == 1
        assert run["step1_seconds"] > 0 and run["steady_step_seconds_median"] > 0
        assert run["mesh_up_seconds"] is not None and 0 < run["mesh_up_seconds"] < run["wall_seconds"]
        assert {"generate", "train", "weight_sync"} <= set(run["phase_seconds_median"])
        assert set(run["services"]) >= {"trainer", "rollout", "reward"}
        assert "error" not in run["services"]["trainer"][0]
        if not shutil.which("nvidia-smi"):
            assert run["gpu_memory"] is None
    assert "--rollout.max_batch_size" in result["runs"]["tuned"]["command"]
    assert result["runs"]["defaults"]["command"][3:] == ["--run.num_steps", "2", "--run.run_dir",
                                                         str(tmp_path / "work" / "defaults" / "runs")]
    assert {"rollout.cuda_graphs", "weight_sync.transport"} <= set(result["resolved"])
    ratio = result["default_over_tuned"]
    assert ratio == pytest.approx(result["runs"]["defaults"]["steady_step_seconds_median"]
                                  / result["runs"]["tuned"]["steady_step_seconds_median"])
    assert set(result["goals"]) == {"steady_step_le_6s", "weight_sync_le_0_2s", "step1_le_1_5x_steady",
                                    "default_over_tuned_le_1_10"}
    assert result["goals"]["steady_step_le_6s"]["met"] is True    # a tiny model on a CPU
    assert result["provenance"]["source_paths"]
