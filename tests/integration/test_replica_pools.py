"""Two replicas of every stateless role behind the coordinator's round-robin; metrics reach TensorBoard."""

import asyncio

import pytest

from coordinator.recipe.config import RunConfig
from coordinator.training import loop
from coordinator.training.algorithms import open_context
from services.common.config import load_config
from services.local import start_local_mesh

pytestmark = pytest.mark.slow


def test_two_reward_and_two_reference_replicas_share_the_calls_round_robin(arith_model_path, tmp_path):
    config = {"model": {"path": arith_model_path}, "rollout": {"n": 4, "max_tokens": 6},
              "algorithm": {"use_kl_loss": True}, "actor": {"lr": 1e-5},
              "data": {"train_files": ["examples/arith/data/train.jsonl"], "rollout_batch_size": 4},
              "run": {"run_dir": str(tmp_path)}}

    async def main():
        mesh = await start_local_mesh(config, num_rollout=2, num_reward=2, num_reference=2)
        try:
            ctx = await open_context("pools", load_config(RunConfig, data=mesh.config))
            counts = {}
            reward_calls = [0] * len(mesh.engines["reward"])
            for i, reward_engine in enumerate(mesh.engines["reward"]):  # the reward engine keeps no count
                def counted(*args, _score=reward_engine.score, _i=i, **kwargs):
                    reward_calls[_i] += 1
                    return _score(*args, **kwargs)
                reward_engine.score = counted
            for _ in range(4):
                await loop.rl_step(ctx)
            for role in ("reward", "reference", "rollout"):
                pool = getattr(ctx, role)
                assert len(pool.healthy()) == 2
            # Each replica's engine saw calls: round robin spreads them.
            ref_calls = [e.num_calls for e in mesh.engines["reference"]]
            assert all(c >= 1 for c in ref_calls), ref_calls
            assert sum(ref_calls) == 4
            assert reward_calls == [2, 2], reward_calls   # one Score per step, alternating
            await ctx.close()
        finally:
            await mesh.stop()
        return counts

    asyncio.run(main())
