"""The loss mask on a trainer mesh (torchrun, gloo, CPU fp32): the mask is one more per-token column of each sample,
cut with it into DP shards and micro-batches and carried in the pipeline's target tensor. A masked batch whose
observation tokens carry huge advantages and log-probs trains on the mesh exactly as a single process trains the
same batch with them zeroed (within the mesh's fp32 reduction-order tolerance)."""

from __future__ import annotations

import asyncio
import copy
import random

import numpy as np
import pytest
from test_trainer_mesh import Launched

from meshrl.v1 import common_pb2, trainer_pb2_grpc
from services.common.rpc.channel import create_channel
from services.common.config import load_config
from services.trainer import convert
from services.trainer.config import TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.testing import make_tiny_model, random_samples
from services.trainer.types import ActorLoss

LOSS = ActorLoss(mini_batch_size=4, kl_coef=0.05, entropy_coef=0.01, policy_loss_settings={"clip_ratio_c": 3.0},
                 ppo_epochs=2)
TOL = 1e-5


def _masked_samples(single: TrainerEngine, value) -> list:
    """Eight samples with an observation block in each response longer than one token; the observation tokens'
    advantages, old and reference log-probs are value(rng)."""
    rng, masks = random.Random(0), random.Random(1)     # the masks do not depend on how many values were drawn
    samples = random_samples(8, seed=1, max_response=12)
    lps = single.compute_logprobs([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    for s, lp in zip(samples, lps):
        n = len(s.response_ids)
        mask = np.ones(n, dtype=np.uint8)
        if n > 2:
            mask[1:n - 1] = [masks.random() < 0.5 for _ in range(n - 2)]
        s.loss_mask = mask
        s.old_logprobs, s.ref_logprobs = list(lp), [x - 0.05 for x in lp]
        for t in np.flatnonzero(mask == 0):
            s.advantages[t], s.old_logprobs[t], s.ref_logprobs[t] = value(rng), value(rng), value(rng)
    assert sum(int((s.loss_mask == 0).sum()) for s in samples) >= 4
    return samples


async def _drive(port: int, samples):
    async with create_channel(f"127.0.0.1:{port}") as channel:
        stub = trainer_pb2_grpc.TrainerStub(channel)
        trained = await stub.TrainActor(convert.train_actor_to_pb(samples, LOSS, columnar=True))
        after = await stub.ComputeLogProbs(common_pb2.LogProbsRequest(sequences=[
            common_pb2.TokenSequence(id=str(i), prompt_ids=s.prompt_ids, response_ids=s.response_ids)
            for i, s in enumerate(samples)], temperature=1.0))
        return trained, after


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [dict(pp_size=2, pipeline_schedule="1f1b"),
                                  dict(dp_size=2, micro_batch_token_budget=24),
                                  dict(tp_size=2, fused_logprobs="true")],
                         ids=["pp2-target-column", "fsdp-dp2-accumulating", "tp2-vocab-parallel-head"])
def test_a_masked_step_on_a_mesh_matches_a_single_process_on_zeroed_observations(tmp_path, mesh):
    model = make_tiny_model(tmp_path / "model", num_hidden_layers=4)
    lines = "".join(f"  {k}: {v}\n" for k, v in mesh.items())
    config = tmp_path / "trainer.yaml"
    config.write_text(f"model:\n  path: {model}\nactor:\n  lr: 1.0e-3\n  seed: 3\n  shuffle: false\n"
                      f"  num_microbatches: 2\n{lines}")
    launched = Launched(config, tmp_path / "torchrun.log", nproc=2)
    try:
        single = TrainerEngine(load_config(TrainerSettings, data={"model": {"path": model}, "actor": {
            "lr": 1e-3, "seed": 3, "shuffle": False}}))
        huge = _masked_samples(single, lambda rng: rng.uniform(-1e4, 1e4))
        zeroed = _masked_samples(single, lambda rng: 0.0)
        expected = single.train_actor(zeroed, LOSS)
        expected_after = single.compute_logprobs([s.prompt_ids for s in zeroed], [s.response_ids for s in zeroed])
        trained, after = asyncio.run(_drive(launched.wait_ready(), copy.deepcopy(huge)))
    finally:
        launched.stop()
    for key in ("pg_loss", "kl_loss", "entropy", "clip_frac", "approx_kl", "grad_norm"):
        assert trained.metrics[key] == pytest.approx(expected[key], abs=TOL), key
    assert trained.metrics["num_tokens"] == expected["num_tokens"] == sum(int(s.loss_mask.sum()) for s in huge)
    for got, want in zip(after.results, expected_after):
        assert list(got.logprobs) == pytest.approx(want, abs=TOL)
