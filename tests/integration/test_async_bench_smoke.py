"""Smoke run of the async benchmark on the CPU: one e2e_grpo.py run in the k = 2 mode (partial rollouts, bypass
correction) on the long-tailed workload, combined by bench/async_rl.py; and the long-tail draws themselves."""

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from bench.peers import long_tail

REPO = Path(__file__).resolve().parents[2]


def test_long_tail_lengths_have_the_asked_median_and_cap():
    draws = long_tail.draws(96.0, 1.0, 1024, seed=1)
    xs = [next(draws) for _ in range(20000)]
    assert 90 <= statistics.median(xs) <= 102 and max(xs) == 1024 and min(xs) >= 1
    assert sum(x > 500 for x in xs) / len(xs) == pytest.approx(1 - 0.5 * (1 + math.erf(math.log(500 / 96) / 2**0.5)),
                                                                abs=0.01)
    with pytest.raises(ValueError, match="MESHRL_BENCH_LENGTHS: expected lognormal"):
        long_tail.parse("normal:96:1:1024:1")


def test_the_trl_side_ends_each_sample_at_its_drawn_length(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from services.rollout.testing import make_tiny_model

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "m", max_position_embeddings=256))
    spec = "lognormal:20:1.0:60:1"
    long_tail.patch_generate(model, 2, spec)
    ids = torch.tensor([[1, 4, 5, 6]] * 8)
    torch.manual_seed(0)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=60, do_sample=False,
                         eos_token_id=2, pad_token_id=0)[:, 4:]
    lengths = [int((row == 2).nonzero()[0]) + 1 if (row == 2).any() else len(row) for row in out]
    drawn = long_tail.draws(*long_tail.parse(spec))
    # Greedy decoding of the tiny model never picks eos on its own (its logit is 0): each row ends where drawn.
    assert lengths == [next(drawn) for _ in range(8)]


@pytest.mark.slow
def test_the_async_benchmark_runs_a_long_tailed_k2_mode_on_the_cpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=f"{REPO}:{REPO / 'protos'}", OMP_NUM_THREADS="1")
    out_dir = tmp_path / "runs"
    subprocess.run([sys.executable, "bench/async_rl.py", "run", "--shape", "arith", "--workloads", "longtail",
                    "--modes", "k2", "--steps", "4", "--warmup-steps", "1", "--length-cap", "12",
                    "--work-dir", str(tmp_path / "work"), "--out-dir", str(out_dir)], cwd=REPO, env=env, check=True)
    subprocess.run([sys.executable, "bench/async_rl.py", "combine", "--out-dir", str(out_dir),
                    "--out", str(tmp_path / "async.json")], cwd=REPO, env=env, check=True)
    result = json.loads((tmp_path / "async.json").read_text())
    k2 = result["workloads"]["longtail"]["modes"]["k2"]
    assert k2["mode"] == {"name": "async-k2-partial-bypass", "async_k": 2, "partial_rollouts": "continue",
                          "correction": "bypass"}
    assert k2["workload"]["median"] == 96.0 and k2["workload"]["cap"] == 12
    assert k2["staleness_max"] == 2 and k2["response_length_max"] <= 12
    run = json.loads(next(out_dir.glob("longtail-k2-r0.json")).read_text())
    assert run["recipe"]["run"]["max_staleness"] == 2 and run["recipe"]["rollout"]["partial_rollouts"] == "continue"
