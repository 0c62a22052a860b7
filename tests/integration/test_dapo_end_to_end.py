"""examples/arith/dapo.yaml for a few steps on real services, sync and async: dynamic sampling leaves no group
without reward variance in any trained batch, each step records its generation batches, and the data position
moves past every prompt generated (no prompt trained twice)."""

import asyncio
import json
from collections import defaultdict
from pathlib import Path

import pytest
import yaml

from coordinator.client import Client
from coordinator.runapi.service import CoordinatorSettings, start as start_coordinator
from services.common.config import deep_merge, load_config
from services.local import start_local_mesh

pytestmark = pytest.mark.slow

NUM_STEPS, BATCH = 3, 4
RECIPE = Path(__file__).resolve().parents[2] / "examples/arith/dapo.yaml"


def records(run_dir: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def check_run(run_dir: Path, async_mode: bool) -> list[int]:
    """Asserts what dynamic sampling promises; returns each step's generation batches."""
    steps = {int(m["step"]): m for m in records(run_dir, "metrics.jsonl") if "reward_mean" in m}
    assert sorted(steps) == list(range(1, NUM_STEPS + 1))
    # Async: the queue stays max_staleness (1) batches ahead, whatever a step took from it.
    assert all(("async/in_flight" in m) == async_mode and m["staleness_max"] <= 1 for m in steps.values())
    gens = [int(steps[s]["train/num_gen_batches"]) for s in sorted(steps)]
    assert all(1 <= g <= 4 for g in gens)
    assert all(steps[s]["train/frac_zero_adv_groups"] == 0 and steps[s]["train/num_groups"] == BATCH for s in steps)
    # The data position moves past every batch generated, dropped groups included.
    positions = [steps[s]["data_position"] for s in sorted(steps)]
    assert positions == [BATCH * sum(gens[:i + 1]) for i in range(NUM_STEPS)]
    # samples.jsonl holds what trained: every group has accuracy variance (exact_match: the reward less the
    # overlong penalty), and no prompt trains twice.
    groups = defaultdict(list)
    for s in records(run_dir, "samples.jsonl"):
        groups[(s["step"], s["id"])].append(s["reward"] - s["overlong_penalty"])
    assert len(groups) == NUM_STEPS * BATCH
    assert all(max(v) > min(v) and len(v) == 8 for v in groups.values())
    prompts = [key[1].rpartition("#")[0] for key in groups]
    assert len(set(prompts)) == len(prompts)
    return gens


@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "async"])
def test_dapo_recipe_trains_only_groups_with_reward_variance(arith_model_path, tmp_path, async_mode):
    recipe = yaml.safe_load(RECIPE.read_text())
    recipe = deep_merge(recipe, {"model": {"path": arith_model_path},
                                 "data": {"rollout_batch_size": BATCH, "heldout_files": []},
                                 "run": {"num_steps": NUM_STEPS, "run_dir": str(tmp_path), "tensorboard": False,
                                         "eval_every": 0, "async_mode": async_mode}})

    async def main():
        mesh = await start_local_mesh(recipe, num_rollout=1, num_reference=0)
        server, port, engine = await start_coordinator(load_config(CoordinatorSettings, data={}), "127.0.0.1:0")
        client = Client(f"127.0.0.1:{port}")
        try:
            run_id = await asyncio.to_thread(client.start_run, yaml.safe_dump(mesh.config))
            final = await asyncio.to_thread(client.wait, run_id)
            assert final.state == "COMPLETED", final.message
            return check_run(Path(final.run_dir), async_mode)
        finally:
            client.close()
            await engine.close()
            await server.stop(0)
            await mesh.stop()

    print({"gen_batches_per_step": asyncio.run(main())})
