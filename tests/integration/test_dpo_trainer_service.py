"""TrainDPO over a real trainer server on port 0: metrics, step and weight version, INVALID_ARGUMENT on bad pairs."""

from __future__ import annotations

import asyncio
import contextlib
import math

import grpc
import pytest

from meshrl.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from services.common.rpc.channel import create_channel
from services.common.config import load_config
from services.trainer import convert
from services.trainer.config import TrainerSettings
from services.trainer.servicer import start
from services.trainer.testing import make_tiny_model
from services.trainer.types import DPOLoss, PreferencePair

METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracy", "logps/chosen",
           "logps/rejected", "grad_norm", "lr")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("dpo_svc_model") / "model")


@contextlib.asynccontextmanager
async def trainer(model_dir: str):
    settings = load_config(TrainerSettings, data={"model": {"path": model_dir}, "actor": {"lr": 1e-3}})
    server, port, engine = await start(settings, "127.0.0.1:0")
    channel = create_channel(f"127.0.0.1:{port}")
    try:
        yield trainer_pb2_grpc.TrainerStub(channel), engine
    finally:
        await channel.close()
        await server.stop(0)
        engine.close()


PAIRS = [PreferencePair([1, 5, 6], [7, 8, 2], [9, 2], -6.0, -4.0),
         PreferencePair([1, 10], [11, 2], [12, 13, 14, 2], -5.0, -9.0),
         PreferencePair([1, 4, 4, 4], [3, 2], [3, 3, 2], -3.5, -6.5)]


def test_train_dpo_over_grpc_reports_every_metric_and_bumps_step_and_weight_version(model_dir):
    async def main():
        async with trainer(model_dir) as (stub, engine):
            trained = await stub.TrainDPO(convert.train_dpo_to_pb(PAIRS, DPOLoss(beta=0.2, mini_batch_size=2)))
            info = await stub.GetInfo(common_pb2.GetInfoRequest())
            return trained, info

    trained, info = asyncio.run(main())
    for key in METRICS:
        assert key in trained.metrics and math.isfinite(trained.metrics[key]), key
    assert trained.step == 2 and trained.metrics["num_optimizer_steps"] == 2
    assert trained.metrics["num_pairs"] == 3
    assert info.weight_version == 1 and info.details["step"] == "2"


def test_bad_pairs_are_invalid_argument_naming_the_field_and_pair_and_nothing_is_applied(model_dir):
    bad_vocab = [PAIRS[0], PreferencePair([1], [3], [99], -1.0, -1.0)]
    nan_ref = [PreferencePair([1], [3], [4], -1.0, float("nan"))]

    async def main():
        async with trainer(model_dir) as (stub, engine):
            errors = []
            for request in (convert.train_dpo_to_pb(bad_vocab, DPOLoss()),
                            convert.train_dpo_to_pb(nan_ref, DPOLoss()),
                            trainer_pb2.TrainDPORequest(),
                            trainer_pb2.TrainDPORequest(pairs=[trainer_pb2.PreferencePair(prompt_ids=[1], chosen_ids=[3])]),
                            convert.train_dpo_to_pb(PAIRS, DPOLoss(loss_type="kto")),
                            convert.train_dpo_to_pb(PAIRS, DPOLoss(beta=-0.1))):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.TrainDPO(request)
                errors.append((err.value.code(), err.value.details()))
            return errors, engine.rank.weight_version, engine.rank.actor.step

    errors, version, step = asyncio.run(main())
    assert all(code == grpc.StatusCode.INVALID_ARGUMENT for code, _ in errors)
    details = [d for _, d in errors]
    assert "pairs[1].rejected_ids: token id 99" in details[0]
    assert "pairs[0].ref_rejected_logprob: not finite" in details[1]
    assert details[2] == "pairs: empty batch"
    assert "pairs[0].rejected_ids: empty" in details[3]
    assert "loss.loss_type" in details[4] and "loss.beta" in details[5]
    assert (version, step) == (0, 0)
