"""bench/lora_train.py (LoRA vs full actor steps through TrainerEngine) runs its three variants on a tiny shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_lora_train_benchmark_runs_full_lora_and_peft_forward_on_a_tiny_shape(tmp_path):
    out = tmp_path / "lora_train.json"
    subprocess.run([sys.executable, str(REPO / "bench" / "lora_train.py"), "--shape", "tiny", "--batch", "2",
                    "--prompt", "8", "--response", "16", "--steps", "2", "--warmup", "1",
                    "--models", str(tmp_path / "models"), "--out", str(out)], check=True, timeout=300)
    result = json.loads(out.read_text())
    rows = {r["variant"]: r for r in result["results"]}
    assert set(rows) == {"full", "lora", "lora_peft"} and all("step_s" in r for r in rows.values())
    assert rows["full"]["trainable_params"] == rows["full"]["params"]
    assert 0 < rows["lora"]["trainable_params"] == rows["lora_peft"]["trainable_params"] < rows["full"]["params"]
    assert result["ratios"]["lora_step_vs_full"] > 0 and result["provenance"]["source_paths"]


@pytest.mark.slow
def test_the_lora_train_benchmark_runs_a_merged_pass_of_several_adapters_beside_one_adapter(tmp_path):
    out = tmp_path / "lora_merged.json"
    subprocess.run([sys.executable, str(REPO / "bench" / "lora_train.py"), "--shape", "tiny", "--batch", "4",
                    "--prompt", "8", "--response", "16", "--steps", "1", "--warmup", "1", "--compile", "false",
                    "--adapters", "2", "--host-profile", "--variants",
                    "lora,lora_merged@full:64,lora_merged_autograd,lora_merged_switching",
                    "--models", str(tmp_path / "models"), "--out", str(out)], check=True, timeout=300)
    result = json.loads(out.read_text())
    rows = {r["variant"]: r for r in result["results"]}
    assert all("step_s" in r for r in rows.values()), rows
    assert rows["lora_merged@full:64"]["micro_batch_token_budget"] == 64
    ratios = result["ratios"]
    assert ratios["lora_merged_step_vs_lora"] > 0 and ratios["lora_merged_autograd_step_vs_lora"] > 0
    assert ratios["lora_merged_switching_step_vs_lora"] > 0
    # the host profile of one more step: the merged pass's own function among the costliest calls
    host = rows["lora_merged@full:64"]["host_top"]
    assert host["total_ms"] > 0 and any("train_together" in row[0] for row in host["top"])
