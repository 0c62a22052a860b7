"""The training API's ForwardBackward and OptimStep on a two-rank (DP) trainer: the Datums split over the ranks,
gradients accumulate over calls on every rank, each Datum's log-probs come back to rank 0 in request order, and
the step matches one process given the same calls."""

from __future__ import annotations

import asyncio

import pytest
from test_trainer_mesh import Launched

from meshrl.v1 import trainer_pb2, trainer_pb2_grpc
from services.common.config import load_config
from services.common.rpc.channel import create_channel
from services.trainer import convert
from services.trainer.config import TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.testing import make_tiny_model
from services.trainer.types import AdamParams, Datum, PrimitiveLoss

ADAM = AdamParams(learning_rate=0.05, eps=1e-6, grad_clip_norm=1.0)


def _datums(seed: int) -> list[Datum]:
    out = []
    for i in range(5):
        tokens = [1] + [3 + (seed * 7 + i * 5 + j * 3) % 28 for j in range(3 + i % 3)]
        n = len(tokens) - 1
        out.append(Datum(tokens[:-1], tokens[1:], logprobs=[-1.0] * n,
                         advantages=[0.0] + [(-1.0) ** i * (1 + i / 4)] * (n - 1)))
    return out


async def _remote(port: int, calls):
    async with create_channel(f"127.0.0.1:{port}") as channel:
        stub = trainer_pb2_grpc.TrainerStub(channel)
        outs = [await stub.ForwardBackward(convert.forward_backward_to_pb(d, PrimitiveLoss(loss))) for d, loss in calls]
        step = await stub.OptimStep(trainer_pb2.OptimStepRequest(adam_params=convert.adam_to_pb(ADAM)))
        after = await stub.ForwardBackward(convert.forward_backward_to_pb(calls[0][0], PrimitiveLoss("cross_entropy")))
        return outs, step, after


@pytest.mark.slow
def test_two_dp_ranks_accumulate_and_step_as_one_process(tmp_path):
    model = make_tiny_model(tmp_path / "model", num_hidden_layers=2)
    config = tmp_path / "trainer.yaml"
    config.write_text(f"model:\n  path: {model}\nactor:\n  lr: 1.0e-6\n  dp_size: 2\n  fused_logprobs: false\n")
    calls = [(_datums(1), "importance_sampling"), (_datums(2), "ppo")]
    launched = Launched(config, tmp_path / "torchrun.log", nproc=2)
    try:
        single = TrainerEngine(load_config(TrainerSettings, data={"model": {"path": model},
                                                                  "actor": {"lr": 1e-6, "fused_logprobs": False}}))
        expected = [single.forward_backward(d, PrimitiveLoss(loss)) for d, loss in calls]
        expected_step = single.optim_step(ADAM)
        expected_after = single.forward_backward(calls[0][0], PrimitiveLoss("cross_entropy"))
        outs, step, after = asyncio.run(_remote(launched.wait_ready(), calls))
    finally:
        launched.stop()
    for out, (metrics, logprobs) in zip(outs, expected):
        assert out.metrics["loss:sum"] == pytest.approx(metrics["loss:sum"], abs=1e-4)
        assert out.metrics["num_tokens"] == metrics["num_tokens"]
        for got, want in zip(out.outputs, logprobs):
            assert list(got.logprobs) == pytest.approx(want, abs=1e-5)
    assert step.metrics["grad_norm"] == pytest.approx(expected_step["grad_norm"], rel=1e-4)
    for got, want in zip(after.outputs, expected_after[1]):
        assert list(got.logprobs) == pytest.approx(want, abs=1e-4)
