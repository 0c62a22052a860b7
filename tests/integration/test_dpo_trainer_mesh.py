"""TrainDPO on a two-rank torchrun trainer (gloo, CPU) against one process: FSDP dp=2 (uneven shards,
accumulating micro-batches) and a two-stage pipeline give the single process's loss, rewards and weights."""

from __future__ import annotations

import asyncio

import pytest

from meshrl.v1 import common_pb2, trainer_pb2_grpc
from services.common.rpc.channel import create_channel
from services.common.config import load_config
from services.trainer import convert
from services.trainer.config import TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.testing import make_tiny_model
from services.trainer.types import DPOLoss
from tests.multiproc.test_trainer_mesh import Launched
from tests.unit.test_trainer_dpo import random_pairs

pytestmark = pytest.mark.slow

# 7 pairs in mini-batches of 4 and 3: the second splits 2/1 over two DP ranks, so one rank pads with a
# zero-weight dummy micro-batch.
LOSS = DPOLoss(beta=0.2, mini_batch_size=4)


def _sequences(pairs):
    return common_pb2.LogProbsRequest(sequences=[
        common_pb2.TokenSequence(id=str(i), prompt_ids=p.prompt_ids, response_ids=r)
        for i, p in enumerate(pairs) for r in (p.chosen_ids, p.rejected_ids)], temperature=1.0)


@pytest.mark.parametrize("mesh", [dict(dp=2, budget=24), dict(pp=2)], ids=["fsdp-dp2-accumulating", "pp2-1f1b"])
def test_a_two_rank_dpo_step_matches_a_single_process_run(tmp_path, mesh):
    dp, pp, budget = mesh.get("dp", 1), mesh.get("pp", 1), mesh.get("budget", 16384)
    model = make_tiny_model(tmp_path / "model", num_hidden_layers=4)
    config = tmp_path / "trainer.yaml"
    config.write_text(f"model:\n  path: {model}\nactor:\n  lr: 1.0e-4\n  seed: 3\n  dp_size: {dp}\n  pp_size: {pp}\n"
                      f"  num_microbatches: 2\n  micro_batch_token_budget: {budget}\n")
    pairs = random_pairs(7, seed=11)
    launched = Launched(config, tmp_path / "torchrun.log", nproc=dp * pp)
    try:
        single = TrainerEngine(load_config(TrainerSettings, data={"model": {"path": model},
                                                                  "actor": {"lr": 1e-4, "seed": 3}}))
        expected = single.train_dpo(pairs, LOSS)
        seqs = _sequences(pairs)
        expected_lp = single.compute_logprobs([s.prompt_ids for s in seqs.sequences],
                                              [s.response_ids for s in seqs.sequences])
        port = launched.wait_ready()

        async def drive():
            async with create_channel(f"127.0.0.1:{port}") as channel:
                stub = trainer_pb2_grpc.TrainerStub(channel)
                trained = await stub.TrainDPO(convert.train_dpo_to_pb(pairs, LOSS))
                lp = await stub.ComputeLogProbs(seqs)
                return trained, lp

        trained, lp = asyncio.run(drive())
    finally:
        launched.stop()
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracy", "logps/chosen",
                "logps/rejected", "grad_norm"):
        assert trained.metrics[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-5), key
    assert trained.step == 2 and trained.metrics["num_tokens"] == expected["num_tokens"]
    assert lp.weight_version == 1
    # Log-probs after the step agree: the ranks applied the single process's update.
    for got, want in zip(lp.results, expected_lp):
        assert list(got.logprobs) == pytest.approx(want, abs=1e-5)
