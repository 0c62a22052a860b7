"""`meshrl up` on one GPU with nothing but a recipe: the `auto` switches pick the fast paths themselves.

A small random Qwen2 on cuda:0 for every service, no speed switch in the recipe: the run's recipe.yaml and the
console say rollout.kv_cache resolved to paged (with its CUDA-graph step) and weight_sync.transport to ipc, the
replica's log shows each update applied over ipc, and every service warmed up before it served. Skipped without CUDA.

    PYTHONPATH=.:protos python -m pytest -q tests/gpu/test_up_defaults.py -s
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

REPO = Path(__file__).resolve().parents[2]


def test_meshrl_up_with_defaults_takes_the_paged_cache_graphs_and_ipc_on_one_gpu(tmp_path):
    from services.rollout.testing import make_tiny_model

    model = make_tiny_model(tmp_path / "model", hidden_size=256, num_hidden_layers=4, max_position_embeddings=256)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"path": model, "device": "cuda", "dtype": "bfloat16"},
        "rollout": {"engine": "torch", "replicas": 1, "n": 4, "max_tokens": 16},
        "reward": {"components": [{"name": "exact_match", "weight": 1.0}]},
        "reference": {"replicas": 1},
        "algorithm": {"adv_estimator": "grpo", "use_kl_loss": True, "kl_loss_coef": 0.001},
        "data": {"train_files": [str(REPO / "examples/arith/data/train.jsonl")], "rollout_batch_size": 8},
        "run": {"name": "up-defaults", "num_steps": 3, "eval_every": 0, "run_dir": str(tmp_path / "runs")},
    }))
    env = {**os.environ, "OMP_NUM_THREADS": "2",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "protos"), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "coordinator.cli", "up", str(recipe)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "resolved: rollout.kv_cache: auto -> paged" in result.stdout
    assert "resolved: rollout.kv_cache_cuda_graphs: auto -> true" in result.stdout
    assert "resolved: weight_sync.transport: auto -> ipc" in result.stdout

    run_dir = next(p for p in (tmp_path / "runs").iterdir() if p.name.startswith("up-defaults"))
    resolved = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    assert resolved["rollout"]["kv_cache"] == "paged" and resolved["rollout"]["kv_cache_cuda_graphs"] is True
    assert resolved["rollout"]["cuda_graphs"] is False          # the paged cache's own graphs decode every row
    assert resolved["rollout"]["max_batch_size"] == 512
    assert resolved["weight_sync"]["transport"] == "ipc"
    assert resolved["actor"]["compile"] is True

    logs = next((tmp_path / "runs" / "logs").iterdir())
    rollout_log = (logs / "rollout-0.log").read_text()
    assert re.search(r"weights version \d+ applied over ipc", rollout_log)
    assert not re.search(r"weights version \d+ applied:", rollout_log)      # the grpc stream's line
    assert "paged KV warm-up (compile + graph capture) took" in rollout_log
    assert "weight_sync.transport auto -> ipc" in (logs / "trainer-0.log").read_text()
    assert "trainer: warm-up (compile) took" in (logs / "trainer-0.log").read_text()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
