"""Issue 22 acceptance: a verl Parquet file and a verl reward file, untouched, train 2 steps through real servers;
extra_info reaches the reward, the reward's extra keys show in metrics.jsonl, a score that fails is recorded as
failed in samples.jsonl and the run goes on."""

import asyncio
import json
import textwrap
from pathlib import Path

import pytest
import yaml

from coordinator.client import Client
from tests.integration.test_coordinator_run_api import with_mesh

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

pytestmark = pytest.mark.slow

# A verl reward file as verl users write it: positional-or-keyword compute_score, a dict with extra keys.
VERL_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["index"] == 0:
        raise RuntimeError("row 0 cannot be scored")
    correct = float(solution_str.strip() == ground_truth)
    return {"score": correct, "acc": correct,
            "extra_info_seen": float(extra_info["answer"] == ground_truth and extra_info["split"] == "train")}
'''


def verl_parquet(path: Path) -> str:
    rows = []
    for i, line in enumerate(Path("examples/arith/data/train.jsonl").read_text().splitlines()[:16]):
        row = json.loads(line)
        rows.append({"data_source": "arith/verl", "prompt": [{"role": "user", "content": row["prompt"]}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": row["answer"]},
                     "extra_info": {"split": "train", "index": i, "answer": row["answer"]}})
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_a_verl_parquet_and_reward_file_train_two_steps_with_extras_in_the_metrics(arith_model_path, tmp_path):
    reward_file = tmp_path / "gsm8k_like.py"
    reward_file.write_text(textwrap.dedent(VERL_REWARD))
    data = verl_parquet(tmp_path / "train.parquet")
    config = {
        "model": {"path": arith_model_path},
        "rollout": {"n": 4, "temperature": 1.0, "max_tokens": 6},
        "actor": {"lr": 1e-5},
        "reward": {"custom_function": {"path": str(reward_file), "name": "compute_score"}, "num_workers": 1},
        "algorithm": {"adv_estimator": "grpo"},
        "data": {"train_files": [data], "heldout_files": [data], "heldout_size": 4, "rollout_batch_size": 4,
                 "shuffle": False, "max_prompt_length": 16},
        "run": {"num_steps": 2, "run_dir": str(tmp_path / "runs")},
    }

    async def body(mesh, address):
        client = Client(address)
        run_id = await asyncio.to_thread(client.start_run, yaml.safe_dump(mesh.config))
        final = await asyncio.to_thread(client.wait, run_id)
        client.close()
        return final

    final = asyncio.run(with_mesh(config, body))
    assert final.state == "COMPLETED", final.message
    assert final.step == 2
    run_dir = Path(final.run_dir)
    steps = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "reward_mean" in r]
    assert len(steps) == 2
    assert all(r["reward_extra/extra_info_seen"] == 1.0 for r in steps)         # extra_info reached the reward
    assert all("reward_extra/acc" in r for r in steps)
    # Unshuffled, step 1 holds rows 0-3: row 0's four samples failed and are counted, not scored 0.
    assert steps[0]["num_reward_failed"] == 4.0 and steps[1]["num_reward_failed"] == 0.0
    records = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 4 * 4                                              # no sample lost
    failed = [r for r in records if r["reward_failed"]]
    assert len(failed) == 4 and all(r["reward"] is None for r in failed)
    assert all("row 0 cannot be scored" in r["reward_error"] and "compute_score" in r["reward_error"] for r in failed)
    ok = [r for r in records if not r["reward_failed"]]
    assert all(r["prompt"].startswith("<s>") and not r["prompt"].startswith("<s><s>") for r in ok)
    assert all(r["data_source"] == "arith/verl" and r["ability"] == "math" and r["extra_info"]["split"] == "train"
               for r in ok)
    assert all(set(r["reward_extras"]) == {"acc", "extra_info_seen"} for r in ok)
    # solution_str is the decoded response only: no prompt, no special tokens
    assert all("<s>" not in r["response"] and "</s>" not in r["response"]
               and not r["response"].startswith(r["prompt"].removeprefix("<s>")) for r in records)
