"""Held-out evaluation scores with the run's own reward: the recipe's components go with the same Score call a
training step makes, to a real reward service on port 0 (the greedy generations are scripted)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np

from coordinator.recipe.config import RunConfig
from coordinator.recipe.data import Problem
from coordinator.training import phases, reporting
from coordinator.training.remote import Sample
from meshrl.v1 import reward_pb2_grpc
from services.common.rpc.channel import create_channel
from services.common.config import load_config
from services.reward.config import RewardSettings
from services.reward.servicer import start

PROBLEMS = [Problem(id=f"q{i}", prompt=f"{i}+1=", ground_truth=str(i + 1), data_source="arith") for i in range(4)]
# Three answers in GSM8K's `#### N` form (right by gsm8k, not an exact match) and one bare right answer (an
# exact match, nothing for strict gsm8k).
RESPONSES = ["#### 1", "#### 2", "#### 3", "4"]


class OneReplica:
    """The reward pool's `call` on one replica, as ReplicaPool.call hands a stub to the request."""

    def __init__(self, stub):
        self.stub = stub

    async def call(self, fn):
        return await fn(self.stub)


def heldout(monkeypatch, recipe_reward: dict, served_reward: dict | None = None) -> dict[str, float]:
    """evaluate() of a run whose recipe says `recipe_reward`, on a reward replica started with `served_reward`."""
    async def generate(ctx, problems, sampling=None, **_):
        assert sampling.temperature == 0.0 and sampling.n == 1      # held-out generations are greedy
        return [Sample(p, i, np.array([1], np.int32), np.array([5], np.int32), np.zeros(1, np.float32), text,
                       "stop", 0) for i, (p, text) in enumerate(zip(problems, RESPONSES))]

    async def main():
        settings = load_config(RewardSettings, data={"reward": served_reward or {}})
        server, port, engine = await start(settings, "127.0.0.1:0")
        try:
            async with create_channel(f"127.0.0.1:{port}", timeout=30) as channel:
                ctx = SimpleNamespace(cfg=RunConfig(reward=recipe_reward), heldout=PROBLEMS, rollout=object(),
                                      reward=OneReplica(reward_pb2_grpc.RewardStub(channel)))
                return await reporting.evaluate(ctx)
        finally:
            await server.stop(0)
            await engine.close()

    monkeypatch.setattr(phases, "generate", generate)
    return asyncio.run(main())


def test_an_exact_match_recipe_scores_held_out_accuracy_as_the_fraction_of_exact_answers(monkeypatch):
    out = heldout(monkeypatch, {"components": [{"name": "exact_match"}]})
    assert out == {"heldout_accuracy": 0.25, "heldout_reward/exact_match": 0.25}


def test_a_gsm8k_recipe_is_evaluated_by_gsm8k_even_beside_an_exact_match_component_it_only_watches(monkeypatch):
    # exact_match at weight 0 is logged, not trained on: the run's reward is gsm8k, and so is its evaluation.
    recipe = {"components": [{"name": "gsm8k", "weight": 1.0}, {"name": "exact_match", "weight": 0.0}]}
    out = heldout(monkeypatch, recipe)
    assert out["heldout_accuracy"] == 0.75
    assert out["heldout_reward/gsm8k"] == 0.75 and out["heldout_reward/exact_match"] == 0.25


def test_a_weighted_recipe_is_evaluated_by_its_weighted_reward(monkeypatch):
    recipe = {"components": [{"name": "gsm8k", "weight": 0.5}, {"name": "exact_match", "weight": 0.5}]}
    assert heldout(monkeypatch, recipe)["heldout_accuracy"] == (0.5 * 3 + 0.5 * 1) / 4


def test_a_reward_function_that_returns_acc_is_evaluated_by_its_acc(monkeypatch, tmp_path):
    # verl's convention: compute_score may return {"score": ..., "acc": ...}; validation reads `acc`.
    (tmp_path / "partial.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    right = solution_str.strip().endswith(ground_truth)\n"
        "    return {'score': 1.0 if right else 0.1, 'acc': float(right and solution_str.startswith('####'))}\n")
    reward = {"components": [{"name": "compute_score", "function": f"{tmp_path / 'partial.py'}:compute_score",
                              "call": "verl"}]}
    out = heldout(monkeypatch, reward, served_reward=reward)
    assert out["heldout_accuracy"] == 0.75               # `acc`, not the mean score (1.0 for every answer here)
    assert out["heldout_reward/compute_score"] == 1.0
