"""A run that starts on a two-rank FSDP trainer that trained before: every rank's shards go back to the model
path's weights and its optimizer state is cleared, so the run's first step matches a fresh single process's."""

from __future__ import annotations

import asyncio

import pytest
from test_trainer_mesh import LOSS, Launched, _samples

from meshrl.v1 import trainer_pb2_grpc
from services.common.rpc.channel import create_channel
from services.common.config import load_config
from services.trainer import convert
from services.trainer.config import OptimSection, RunOptim, TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.testing import make_tiny_model
from services.trainer.types import RunStart

RUN = OptimSection(lr=0.05, grad_clip=0.5)


async def _train_start_train(port: int, first, second):
    async with create_channel(f"127.0.0.1:{port}") as channel:
        stub = trainer_pb2_grpc.TrainerStub(channel)
        await stub.ConfigureRun(convert.run_optim_to_pb(RunOptim(RUN)))
        await stub.TrainActor(convert.train_actor_to_pb(first, LOSS))
        started = convert.run_optim_from_pb(
            await stub.ConfigureRun(convert.run_optim_to_pb(RunOptim(RUN, start=RunStart()))))
        return started, await stub.TrainActor(convert.train_actor_to_pb(second, LOSS))


@pytest.mark.slow
def test_a_run_started_on_a_used_two_rank_trainer_steps_as_a_fresh_single_process(tmp_path):
    model = make_tiny_model(tmp_path / "model", num_hidden_layers=2)
    config = tmp_path / "trainer.yaml"
    config.write_text(f"model:\n  path: {model}\nactor:\n  lr: 1.0e-6\n  seed: 3\n  dp_size: 2\n"
                      f"  micro_batch_token_budget: 24\n")
    launched = Launched(config, tmp_path / "torchrun.log", nproc=2)
    try:
        single = TrainerEngine(load_config(TrainerSettings, data={"model": {"path": model}, "actor": {
            "seed": 3, "micro_batch_token_budget": 24, "lr": RUN.lr, "grad_clip": RUN.grad_clip}}))
        first, second = _samples(1, single), _samples(2, single)
        expected = single.train_actor(second, LOSS)
        started, trained = asyncio.run(_train_start_train(launched.wait_ready(), first, second))
    finally:
        launched.stop()
    assert started.started_from == f"model.path {model} (weights reloaded, optimizer state cleared)"
    assert started.weight_version == 2
    for key in ("pg_loss", "grad_norm"):
        assert trained.metrics[key] == pytest.approx(expected[key], abs=1e-5), key
