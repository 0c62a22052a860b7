"""bench/trainer_fit.py on a tiny shape (CPU): full fine-tuning and LoRA actor steps with checkpointing run and
write their JSON; LoRA trains a small share of the weights."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_fit_benchmark_runs_full_and_lora_on_a_tiny_shape(tmp_path):
    out = tmp_path / "fit.json"
    subprocess.run([sys.executable, "bench/trainer_fit.py", "--sizes", "tiny", "--batch", "2", "--seq", "32",
                    "--steps", "2", "--out", str(out)], cwd=REPO, check=True, capture_output=True)
    rows = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["full"]["fits"] and rows["lora"]["fits"]
    assert rows["full"]["trainable_params"] == rows["full"]["num_params"]
    assert 0 < rows["lora"]["trainable_params"] < rows["full"]["num_params"] / 2
    assert rows["lora"]["num_params"] == rows["full"]["num_params"]
