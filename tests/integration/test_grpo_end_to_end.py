"""Issue 2 acceptance: 3 GRPO steps through real servers on port 0 (trainer, reference, reward, 2 rollouts)."""

import asyncio

import pytest

from coordinator.recipe.config import RunConfig
from coordinator.training import loop, remote
from coordinator.training.algorithms import open_context
from services.common.config import load_config
from services.local import start_local_mesh
from services.reward.functions import exact_match

pytestmark = pytest.mark.slow


def _config(model_path: str, tmp_path) -> dict:
    return {
        "model": {"path": model_path, "dtype": "float32"},
        "rollout": {"n": 4, "temperature": 1.0, "max_tokens": 6},
        "actor": {"lr": 1e-3},
        "reward": {"components": [{"name": "exact_match", "weight": 1.0}]},
        "algorithm": {"adv_estimator": "grpo", "use_kl_loss": True, "kl_loss_coef": 0.01, "logprob_parity_every": 1},
        "data": {"train_files": ["examples/arith/data/train.jsonl"], "rollout_batch_size": 4},
        "run": {"num_steps": 3, "run_dir": str(tmp_path)},
    }


def test_three_grpo_steps_sync_weights_to_every_replica_with_logprob_parity(arith_model_path, tmp_path):
    async def main():
        mesh = await start_local_mesh(_config(arith_model_path, tmp_path), num_rollout=2)
        try:
            cfg = load_config(RunConfig, data=mesh.config)
            ctx = await open_context("e2e", cfg)
            assert len(ctx.rollout.healthy()) == 2
            for step in range(1, 4):
                metrics = await loop.rl_step(ctx)
                samples = ctx.last_samples
                # every prompt got n samples
                groups = {}
                for s in samples:
                    groups.setdefault(s.group, []).append(s)
                assert len(groups) == 4 and all(len(g) == 4 for g in groups.values())
                # rewards equal the exact-match rule applied to the decoded text
                for s in samples:
                    assert s.reward == exact_match(prompt=s.problem.prompt, response=s.text,
                                                   response_ids=s.response_ids, ground_truth=s.problem.ground_truth,
                                                   data_source=s.problem.data_source)
                # every rollout replica reports the trainer's weight version
                trainer_info = await remote.info(ctx.trainer)
                assert trainer_info.weight_version == step == ctx.weight_version
                for address in mesh.addresses["rollout"]:
                    rep = ctx.rollout.replicas[address]
                    assert (await remote.info(rep.stub)).weight_version == trainer_info.weight_version
                assert metrics["weight_version"] == step
                # after the sync, rollout log-probs of a fixed sequence equal the trainer's (fp32)
                fixed = samples[:3]
                want = await remote.logprobs(ctx.trainer, fixed)
                for address in mesh.addresses["rollout"]:
                    got = await remote.logprobs(ctx.rollout.replicas[address].stub, fixed)
                    diff = max(abs(a - b) for ga, gb in zip(got, want) for a, b in zip(ga, gb))
                    assert diff < 1e-4, (address, diff)
                assert "kl" in metrics and metrics["rollout_vs_trainer/logprob_abs_diff"] < 1e-4
            await ctx.close()
        finally:
            await mesh.stop()

    asyncio.run(main())
