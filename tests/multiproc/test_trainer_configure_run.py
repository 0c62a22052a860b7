"""ConfigureRun on a two-rank trainer: every rank takes the run's optimizer settings, so the mesh's next steps
match a single process started with those settings."""

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

RUN = OptimSection(lr=0.05, weight_decay=0.01, betas=(0.8, 0.9), grad_clip=0.5)


async def _configure_and_train(port: int, first, second):
    async with create_channel(f"127.0.0.1:{port}") as channel:
        stub = trainer_pb2_grpc.TrainerStub(channel)
        applied = convert.run_optim_from_pb(await stub.ConfigureRun(convert.run_optim_to_pb(RunOptim(RUN))))
        await stub.TrainActor(convert.train_actor_to_pb(first, LOSS))
        return applied, await stub.TrainActor(convert.train_actor_to_pb(second, LOSS))


@pytest.mark.slow
def test_every_rank_of_a_two_rank_trainer_takes_the_runs_optimizer_settings(tmp_path):
    model = make_tiny_model(tmp_path / "model", num_hidden_layers=2)
    config = tmp_path / "trainer.yaml"
    config.write_text(f"model:\n  path: {model}\nactor:\n  lr: 1.0e-6\n  seed: 3\n  dp_size: 2\n"
                      f"  micro_batch_token_budget: 24\n")
    launched = Launched(config, tmp_path / "torchrun.log", nproc=2)
    try:
        actor = {"seed": 3, "micro_batch_token_budget": 24, **{k: getattr(RUN, k) for k in ("lr", "weight_decay",
                                                                                           "grad_clip")},
                 "betas": list(RUN.betas)}
        single = TrainerEngine(load_config(TrainerSettings, data={"model": {"path": model}, "actor": actor}))
        first, second = _samples(1, single), _samples(2, single)
        single.train_actor(first, LOSS)
        expected = single.train_actor(second, LOSS)
        applied, trained = asyncio.run(_configure_and_train(launched.wait_ready(), first, second))
    finally:
        launched.stop()
    assert applied.actor == RUN
    assert trained.metrics["lr"] == 0.05
    for key in ("pg_loss", "grad_norm"):
        assert trained.metrics[key] == pytest.approx(expected[key], abs=1e-5), key
