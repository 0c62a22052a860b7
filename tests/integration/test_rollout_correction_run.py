"""algorithm.rollout_correction in a short real run: its `rollout_corr/` metrics land in metrics.jsonl."""

import asyncio
import json
from pathlib import Path

import pytest
import yaml

from coordinator.client import Client
from tests.integration.test_coordinator_run_api import base_config, with_mesh

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("correction,steps_with_metrics", [
    # decoupled: the trainer's old log-probs are computed, and the correction measured, on every step
    ({"mode": "decoupled", "level": "sequence", "method": "truncate", "threshold": 2.0}, [1, 2, 3, 4]),
    # bypass: measured on the parity steps only (step 1 and every 3rd): not on steps 2 and 4
    ({"mode": "bypass"}, [1, 3]),
    ({"mode": "decoupled", "level": "geometric", "method": "mask", "threshold": 1.5}, [1, 2, 3, 4]),
    # a preset: decoupled, geometric rejection and the token veto (docs/algorithms.md)
    ({"preset": "geo_rs"}, [1, 2, 3, 4]),
])
def test_the_corrections_metrics_appear_in_metrics_jsonl(arith_model_path, tmp_path, correction, steps_with_metrics):
    config = base_config(arith_model_path, tmp_path, run={"num_steps": 4},
                         algorithm={"adv_estimator": "grpo", "rollout_correction": correction,
                                    "logprob_parity_every": 3}, data={"heldout_size": 0, "heldout_files": []})

    async def body(mesh, address):
        client = Client(address)
        run_id = await asyncio.to_thread(client.start_run, yaml.safe_dump(mesh.config))
        final = await asyncio.to_thread(client.wait, run_id)
        client.close()
        assert final.state == "COMPLETED", final
        records = [json.loads(line) for line in (Path(final.run_dir) / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in records if "reward_mean" in r]
        assert [int(r["step"]) for r in steps] == [1, 2, 3, 4]
        assert [int(r["step"]) for r in steps if "rollout_corr/ess" in r] == steps_with_metrics
        # a step without the measurement has none of its metrics (no stale or zero stand-ins)
        assert not any(k.startswith("rollout_corr/") for r in steps if int(r["step"]) not in steps_with_metrics
                       for k in r)
        for r in (r for r in steps if int(r["step"]) in steps_with_metrics):
            assert 0 < r["rollout_corr/ess"] <= 1 + 1e-6 and r["rollout_corr/kl_k3"] >= -1e-6
            assert {"rollout_corr/weight_mean", "rollout_corr/weight_max", "rollout_corr/kl_k1",
                    "rollout_corr/log_ppl_diff"} <= set(r)
            share = "rollout_corr/fraction_masked" if correction.get("method") == "mask" or "preset" in correction \
                else "rollout_corr/fraction_truncated"
            assert 0 <= r[share] <= 1
            if "preset" in correction:
                assert 0 <= r["rollout_corr/fraction_vetoed"] <= r[share]

    asyncio.run(with_mesh(config, body, num_rollout=1))
