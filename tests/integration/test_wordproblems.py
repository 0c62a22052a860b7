"""The word-problem example through `meshrl up`: verl's GSM8K command line of docs/from_verl.md starts a run on the
example's files and trains; the example's GRPO recipe raises held-out accuracy."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "examples/wordproblems/model"

pytestmark = pytest.mark.skipif(not (MODEL / "config.json").exists(),
                                reason="run `python -m examples.wordproblems.sft` to build the example's model")


def _meshrl(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "coordinator.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


def doc_command_line() -> list[str]:
    """The verl GSM8K command line docs/from_verl.md shows, as words."""
    text = (REPO / "docs/from_verl.md").read_text()
    block = text.split("<!-- verl-gsm8k-line")[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return shlex.split(block.replace("\\\n", " "))


def only_run_dir(root: Path, prefix: str) -> Path:
    found = [p for p in root.iterdir() if p.name.startswith(prefix)]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.slow
def test_the_verl_gsm8k_command_line_of_the_docs_trains_two_steps_on_the_example(tmp_path):
    words = doc_command_line()
    assert words[:3] == ["meshrl", "up", "examples/wordproblems/grpo.yaml"]
    # verl's own way to shorten the line: total_training_steps wins over total_epochs.
    result = _meshrl(*words[1:], "trainer.total_training_steps=2", "--run-dir", str(tmp_path),
                     "--data.heldout_size", "20", "--rollout.replicas", "1")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert any(line.startswith("step   2/2") for line in result.stdout.splitlines()), result.stdout[-3000:]
    run_dir = only_run_dir(tmp_path, "wordproblems-grpo")  # trainer.experiment_name
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and {"accuracy_before", "accuracy_after"} <= set(summary)
    # What every service read: the verl keys' values with verl's meaning.
    recipe = yaml.safe_load(next((tmp_path / "logs").glob("*/recipe.yaml")).read_text())
    assert recipe["algorithm"]["ppo_mini_batch_size"] == 16 * 8       # 16 prompts x rollout.n samples
    assert recipe["actor"]["micro_batch_token_budget"] == 64 * (64 + 24)
    assert recipe["rollout"]["max_tokens"] == 24 and recipe["rollout"]["engine"] == "torch"
    assert recipe["algorithm"]["kl_loss_type"] == "k3"
    assert recipe["reward"]["custom_function"] == {"path": "examples/wordproblems/reward.py", "name": "compute_score"}
    assert recipe["run"]["num_steps"] == 2 and recipe["run"]["eval_every"] == 20
