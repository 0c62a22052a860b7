"""A trainer with actor.activation_checkpointing on pushes its weights to a real rollout replica over grpc:
the replica takes every tensor under the model's own names and answers the trainer's log-probs."""

from __future__ import annotations

import asyncio

import pytest

from meshrl.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from services.common.rpc.channel import create_channel
from services.common.config import load_config
from services.trainer.testing import random_samples
from tests.integration.test_weight_sync import TOKEN, assert_parity, sequences_pb, served, train_once


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from services.rollout.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("ac_sync_model"))


async def _push_after_a_step(model_dir: str, mode: str, samples):
    from services.rollout.config import RolloutSettings
    from services.rollout.servicer import start as start_rollout
    from services.trainer.config import TrainerSettings
    from services.trainer.servicer import start as start_trainer

    settings = load_config(TrainerSettings, data={
        "model": {"path": model_dir}, "actor": {"lr": 1e-3, "activation_checkpointing": mode},
        "server": {"auth_token": TOKEN}})
    mesh, port, engine = await start_trainer(settings, "127.0.0.1:0")
    rmesh, rport, replica = await start_rollout(RolloutSettings(model={"path": model_dir},
                                                                server={"auth_token": TOKEN}), "127.0.0.1:0")
    try:
        async with create_channel(f"127.0.0.1:{port}", token=TOKEN) as channel:
            stub = trainer_pb2_grpc.TrainerStub(channel)
            target = f"127.0.0.1:{rport}"
            before = await served(target, samples)
            await train_once(stub, samples)
            pushed = await stub.PushWeights(trainer_pb2.PushWeightsRequest(targets=[target], bucket_bytes=8192))
            want = [list(r.logprobs) for r in (await stub.ComputeLogProbs(sequences_pb(samples))).results]
            return before, pushed, want, await served(target, samples)
    finally:
        await rmesh.stop(0)
        await replica.close()
        await mesh.stop(0)
        engine.close()


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_checkpointed_trainer_syncs_a_rollout_replica(model_dir, mode):
    samples = random_samples(4, vocab_size=32)
    before, pushed, want, after = asyncio.run(_push_after_a_step(model_dir, mode, samples))
    assert [r.ok for r in pushed.results] == [True], [r.error for r in pushed.results]
    assert after[0] == 1 and after[0] == pushed.weight_version
    assert_parity(after[1], want)
    assert after[1] != before[1]
