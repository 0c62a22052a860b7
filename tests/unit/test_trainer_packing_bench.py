"""bench/trainer_packing.py on CPU tiny shapes: a smoke check of the script and of its committed CPU results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_the_committed_cpu_results_hold_both_variants_of_each_pair():
    data = json.loads((REPO / "bench" / "results" / "trainer_packing_cpu.json").read_text())
    spread, memory = data["spread"], data["memory"]
    for side in ("padded", "packed"):
        assert spread[side]["actor_tokens_per_s"] > 0 and spread[side]["logprobs_tokens_per_s"] > 0
    assert spread["packed_over_padded_actor"] == pytest.approx(
        spread["packed"]["actor_tokens_per_s"] / spread["padded"]["actor_tokens_per_s"])
    for what in ("actor", "logprobs"):
        assert {"extra_gb"} <= set(memory[f"{what}_fused"]) and {"extra_gb"} <= set(memory[f"{what}_full_logits"])


@pytest.mark.slow
def test_the_spread_workload_runs_on_cpu(tmp_path):
    out = tmp_path / "packing.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}:{REPO / 'protos'}"}
    subprocess.run([sys.executable, "bench/trainer_packing.py", "--device", "cpu", "--tiny", "--parts", "spread",
                    "--steps", "1", "--warmup", "0", "--out", str(out)], cwd=REPO, env=env, check=True,
                   capture_output=True, timeout=900)
    spread = json.loads(out.read_text())["spread"]
    assert spread["tokens"] > spread["samples"] and spread["length_max"] > spread["length_median"]
    assert spread["packed"]["actor_tokens_per_s"] > 0 and spread["padded"]["actor_tokens_per_s"] > 0
    # Packed rows compute the real tokens only; a plain trainer's rows (padded to each micro-batch's longest) pad
    # more than the trainer's length-sorted ones.
    slots = {k: spread[k]["token_slots"] for k in ("packed", "padded", "padded_longest")}
    assert slots["packed"] == spread["tokens"] < slots["padded"] < slots["padded_longest"]
    assert spread["packed_over_padded_actor_vs_padded_longest"] > 0
