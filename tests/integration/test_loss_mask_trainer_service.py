"""The loss mask over gRPC: coordinator Samples of multi-turn episodes (observation tokens between the model's turns)
reach a real trainer service (port 0, examples/arith/model) through TrainActor's and TrainCritic's columns; a
batch whose observation tokens carry huge advantages, log-probs and returns trains exactly like the same batch
with them zeroed, and the metrics count the model's tokens only."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import random
from pathlib import Path

import numpy as np
import pytest

from coordinator.recipe.data import Problem
from coordinator.training import remote
from services.common.rpc.channel import create_channel
from services.common.config import load_config
from services.trainer.config import TrainerSettings
from services.trainer.servicer import start
from services.trainer.types import ActorLoss, CriticLoss, RunStep

MODEL = str(Path(__file__).resolve().parents[2] / "examples" / "arith" / "model")
LOSS = ActorLoss(kl_coef=0.05, entropy_coef=0.01, policy_loss_settings={"clip_ratio_c": 3.0}, ppo_epochs=2,
                 mini_batch_size=3)


@contextlib.asynccontextmanager
async def trainer(**sections):
    data = {"model": {"path": MODEL}, "actor": {"lr": 1e-3, "seed": 11, "shuffle": False}, **sections}
    mesh, port, engine = await start(load_config(TrainerSettings, data=data), "127.0.0.1:0")
    channel = create_channel(f"127.0.0.1:{port}")
    try:
        yield remote.trainer_stub(channel)
    finally:
        await channel.close()
        await mesh.stop(0)
        engine.close()


def _episodes(seed: int = 0) -> list[remote.Sample]:
    """Six episodes: a model turn, an observation block, another model turn (token ids of the arith vocabulary)."""
    rng = random.Random(seed)
    out = []
    for i in range(6):
        mask = [1] * rng.randint(2, 6) + [0] * rng.randint(2, 6) + [1] * rng.randint(1, 5)
        n = len(mask)
        ids = np.array([rng.randrange(3, 44) for _ in range(n)], dtype=np.int32)
        s = remote.Sample(Problem(id=f"q{i}", prompt="1+1=", ground_truth="2", data_source="arith"), i // 2,
                          np.array([rng.randrange(3, 44) for _ in range(5)], dtype=np.int32), ids,
                          np.zeros(n, dtype=np.float32), "", "stop", 0, loss_mask=np.array(mask, dtype=np.uint8))
        s.advantages = np.array([rng.uniform(-1, 1) for _ in range(n)], dtype=np.float32)
        s.returns = [rng.uniform(-1, 1) for _ in range(n)]
        # Filled on the model's tokens from the trainer (_train); the observation tokens' are the test's.
        s.old_logprobs, s.ref_logprobs, s.values = (np.zeros(n, dtype=np.float32) for _ in range(3))
        out.append(s)
    return out


def _observations_set_to(samples: list[remote.Sample], value) -> list[remote.Sample]:
    rng = random.Random(5)
    out = copy.deepcopy(samples)
    for s in out:
        obs = s.loss_mask == 0
        for name in ("advantages", "old_logprobs", "ref_logprobs", "returns", "values"):
            row = np.array(getattr(s, name), dtype=np.float32)
            row[obs] = [value(rng) for _ in range(int(obs.sum()))]
            setattr(s, name, row)
    return out


async def _train(samples: list[remote.Sample]):
    """Old and reference log-probs from the trainer itself, then a critic and an actor update, then the new
    log-probs (which show the updated weights)."""
    async with trainer(critic={"lr": 1e-3}) as stub:
        lps = await remote.logprobs(stub, samples)
        for s, lp in zip(samples, lps):
            keep = s.loss_mask == 1
            s.old_logprobs = np.where(keep, lp, s.old_logprobs).astype(np.float32)
            s.ref_logprobs = np.where(keep, lp - 0.03, s.ref_logprobs).astype(np.float32)
            s.values = np.where(keep, 0.1, s.values).astype(np.float32)
        step = RunStep("mask-run", 1, 6)
        critic = await remote.train_critic(stub, samples, CriticLoss(clip_value=0.2, mini_batch_size=3), step)
        _, actor = await remote.train_actor(stub, samples, LOSS, step)
        after = await remote.logprobs(stub, samples)
    return actor, critic, after


def test_observation_tokens_with_huge_values_train_exactly_like_zeroed_ones_over_grpc():
    base = _episodes()
    huge = _observations_set_to(base, lambda rng: rng.uniform(-1e4, 1e4))
    zeroed = _observations_set_to(base, lambda rng: 0.0)
    got_actor, got_critic, got_after = asyncio.run(_train(huge))
    want_actor, want_critic, want_after = asyncio.run(_train(zeroed))
    for key in ("pg_loss", "kl_loss", "entropy_loss", "loss", "entropy", "clip_frac", "approx_kl", "grad_norm",
                "num_tokens"):
        assert got_actor[key] == want_actor[key], key
    for key in ("vf_loss", "vf_clip_frac", "values_mean", "grad_norm", "num_tokens"):
        assert got_critic[key] == want_critic[key], key
    for a, b in zip(got_after, want_after):
        assert np.array_equal(a, b)
    model_tokens = sum(int(s.loss_mask.sum()) for s in base)
    assert got_actor["num_tokens"] == got_critic["num_tokens"] == model_tokens
    assert model_tokens < sum(len(s.response_ids) for s in base)
    # The update moved the weights (the equality is not two untouched models).
    first = asyncio.run(_before(base))
    assert any(not np.allclose(a, b) for a, b in zip(first, got_after))


async def _before(samples):
    async with trainer(critic={"lr": 1e-3}) as stub:
        return await remote.logprobs(stub, samples)


def test_without_the_mask_the_same_huge_batch_trains_differently():
    # The control: the equality above is the mask's doing, not an update that ignores the advantages.
    huge = _observations_set_to(_episodes(), lambda rng: rng.uniform(-1e4, 1e4))
    zeroed = _observations_set_to(_episodes(), lambda rng: 0.0)
    for s in huge + zeroed:
        s.loss_mask = None
    got, _, _ = asyncio.run(_train_unmasked(huge))
    want, _, _ = asyncio.run(_train_unmasked(zeroed))
    assert got["pg_loss"] != pytest.approx(want["pg_loss"])
    assert got["num_tokens"] == sum(len(s.response_ids) for s in huge)


async def _train_unmasked(samples):
    async with trainer() as stub:
        lps = await remote.logprobs(stub, samples)
        for s, lp in zip(samples, lps):
            s.old_logprobs, s.ref_logprobs = lp, lp - 0.03
        _, actor = await remote.train_actor(stub, samples, LOSS)
    return actor, None, None
