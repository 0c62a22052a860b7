"""A GRPO step whose samples are multi-turn episodes, through real servers on port 0 (trainer, reference, reward,
a rollout replica, an env replica) on the committed arith model: the coordinator plays the step as env_agent
episodes in the rollout replica, and the loss mask and episode metrics come back with the step."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from transformers import AutoTokenizer

from coordinator.recipe.config import RunConfig
from coordinator.training import loop
from coordinator.training.algorithms import open_context
from services.common.config import load_config
from services.env.types import StepResult
from services.local import start_local_mesh, start_role

pytestmark = pytest.mark.slow


class PlusOne:
    """A two-step environment small enough for the arith model's 64 positions: after each answer it asks for one
    more (`+1=`), and the episode is over after the second answer."""

    def reset(self, **kwargs) -> str:
        self.steps = 0
        return ""

    def step(self, action: str) -> StepResult:
        self.steps += 1
        return StepResult("+1=", reward=float(self.steps), done=self.steps >= 2)


def test_a_grpo_step_of_env_agent_episodes_trains_on_the_models_tokens_only(arith_model_path, tmp_path):
    async def main():
        env_server, env_port, env_engine = await start_role(
            "env", {"env": {"builtin_tools": [], "environments": {
                "plus_one": "tests.integration.test_episodes_e2e:PlusOne"}}})
        config = {
            "model": {"path": arith_model_path, "dtype": "float32"},
            "rollout": {"n": 4, "temperature": 1.0, "max_tokens": 6,
                        "agent": {"name": "env_agent", "environment": "plus_one", "max_turns": 3,
                                  "max_total_tokens": 24}},
            "env": {"servers": [f"127.0.0.1:{env_port}"]},
            "actor": {"lr": 1e-3},
            "reward": {"components": [{"name": "exact_match", "weight": 1.0}]},
            "algorithm": {"adv_estimator": "grpo"},
            "data": {"train_files": ["examples/arith/data/train.jsonl"], "rollout_batch_size": 4},
            "run": {"num_steps": 1, "run_dir": str(tmp_path)},
        }
        mesh = await start_local_mesh(config, num_rollout=1, num_reference=0)
        # The samples of the TrainActor request, as the trainer received them.
        trainer = mesh.engines["trainer"][0]
        train_actor_step = trainer.train_actor_step
        trainer.train_actor_step = lambda samples, *args: (received.extend(samples), train_actor_step(samples, *args))[1]
        try:
            ctx = await open_context("episodes-e2e", load_config(RunConfig, data=mesh.config))
            metrics = await loop.rl_step(ctx)
            samples = ctx.last_samples
            await ctx.close()
            return metrics, samples
        finally:
            await mesh.stop()
            await env_server.stop(0)
            await env_engine.close()

    received = []
    metrics, samples = asyncio.run(main())
    assert len(samples) == 16
    for s in samples:
        assert s.episode["end_reason"] in ("answer", "length") and s.episode["num_turns"] >= 1
        mask = np.asarray(s.loss_mask)
        assert len(mask) == len(s.response_ids) and mask[0] == 1
        if s.episode["num_turns"] == 2 and s.episode["end_reason"] == "answer":
            assert s.episode["env_reward"] == 3.0 and (mask == 0).sum() > 0
    assert metrics["end_reason/answer"] + metrics.get("end_reason/length", 0.0) == pytest.approx(1.0)
    assert metrics["turns_per_episode"] > 1.0 and metrics["num_observation_tokens"] > 0
    # Only the model's tokens train: the trainer got every episode's mask, 0 on exactly the observation tokens
    # (the environment's "+1=" turns), and counted only the 1s.
    tokenizer = AutoTokenizer.from_pretrained(arith_model_path)
    by_response = {tuple(s.response_ids): s for s in samples}
    assert len(received) == 16 and {tuple(r.response_ids) for r in received} == set(by_response)
    observed = 0
    for r in received:
        mask = np.asarray(r.loss_mask if len(r.loss_mask) else np.ones(len(r.response_ids)), dtype=int)
        assert mask.tolist() == np.asarray(by_response[tuple(r.response_ids)].loss_mask).tolist()
        zeros = np.flatnonzero(mask == 0)
        if len(zeros):
            assert "+1=" in tokenizer.decode([r.response_ids[i] for i in zeros]).replace(" ", "")
        observed += len(zeros)
    assert observed == metrics["num_observation_tokens"] > 0
    assert metrics["actor/num_tokens"] == sum(len(s.response_ids) for s in samples) - observed
