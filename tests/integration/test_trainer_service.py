"""A real trainer server on port 0: log-probs, updates, info, bad input, checkpoints and weight pushes."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from meshrl.v1 import common_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from services.common.rpc.channel import create_channel
from services.common.config import load_config
from services.trainer import convert
from services.trainer.config import TrainerSettings
from services.trainer.servicer import start
from services.trainer.testing import random_samples, sequences_pb
from services.trainer.types import ActorLoss

TOKEN = "s3cret"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    # The rollout's tiny model carries a char tokenizer, which a real rollout replica needs.
    from services.rollout.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("trainer_svc_model"))


@contextlib.asynccontextmanager
async def trainer(model_dir: str, **sections):
    data = {"model": {"path": model_dir}, "actor": {"lr": 1e-3}, "server": {"auth_token": TOKEN}}
    for k, v in sections.items():
        data[k] = {**data.get(k, {}), **v}
    settings = load_config(TrainerSettings, data=data)
    mesh, port, engine = await start(settings, "127.0.0.1:0")
    channel = create_channel(f"127.0.0.1:{port}", token=TOKEN)
    try:
        yield trainer_pb2_grpc.TrainerStub(channel), engine
    finally:
        await channel.close()
        await mesh.stop(0)
        engine.close()


def test_compute_logprobs_train_actor_and_get_info_over_grpc(model_dir):
    samples = random_samples(6, vocab_size=32)

    async def main():
        async with trainer(model_dir) as (stub, engine):
            lp = await stub.ComputeLogProbs(sequences_pb(samples))
            for s, r in zip(samples, lp.results):
                s.old_logprobs = list(r.logprobs)
            trained = await stub.TrainActor(convert.train_actor_to_pb(samples, ActorLoss(mini_batch_size=3)))
            info = await stub.GetInfo(common_pb2.GetInfoRequest())
            lp2 = await stub.ComputeLogProbs(sequences_pb(samples))
            return lp, trained, info, lp2

    lp, trained, info, lp2 = asyncio.run(main())
    assert [r.id for r in lp.results] == [f"s{i}" for i in range(6)]
    assert [len(r.logprobs) for r in lp.results] == [len(s.response_ids) for s in samples]
    assert lp.weight_version == 0 and lp2.weight_version == 1
    assert trained.step == 2
    assert {"pg_loss", "kl_loss", "entropy", "clip_frac", "approx_kl", "grad_norm", "lr", "tokens_per_s",
            "num_tokens"} <= set(trained.metrics)
    assert trained.metrics["num_tokens"] == sum(len(s.response_ids) for s in samples)
    assert info.role == "trainer" and info.weight_version == 1
    assert (info.details["tp"], info.details["pp"], info.details["dp"], info.details["world_size"]) == ("1", "1", "1",
                                                                                                         "1")
    assert info.details["devices"] == "cpu" and info.details["step"] == "2" and info.details["dtype"] == "float32"
    assert lp2.results[0].logprobs != lp.results[0].logprobs


def test_bad_input_is_invalid_argument_naming_the_field_and_a_missing_critic_is_failed_precondition(model_dir):
    samples = random_samples(2, vocab_size=32)
    samples[1].advantages = samples[1].advantages[:-1] if len(samples[1].advantages) > 1 else []

    async def main():
        async with trainer(model_dir) as (stub, engine):
            errors = []
            for call in (stub.TrainActor(convert.train_actor_to_pb(samples, ActorLoss())),
                         stub.TrainActor(trainer_pb2.TrainActorRequest()),
                         stub.ComputeLogProbs(common_pb2.LogProbsRequest(sequences=[
                             common_pb2.TokenSequence(id="x", prompt_ids=[1], response_ids=[99])])),
                         stub.ComputeValues(trainer_pb2.ValuesRequest(sequences=[
                             common_pb2.TokenSequence(id="x", prompt_ids=[1], response_ids=[3])])),
                         stub.PushWeights(trainer_pb2.PushWeightsRequest())):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                errors.append((err.value.code(), err.value.details()))
            return errors, engine.rank.weight_version

    errors, version = asyncio.run(main())
    assert errors[0][0] == grpc.StatusCode.INVALID_ARGUMENT and "samples[1].advantages" in errors[0][1]
    assert errors[1] == (grpc.StatusCode.INVALID_ARGUMENT, "samples: empty batch")
    assert errors[2][0] == grpc.StatusCode.INVALID_ARGUMENT and "sequences[0].response_ids" in errors[2][1]
    assert errors[3] == (grpc.StatusCode.FAILED_PRECONDITION,
                         "no critic configured (add a `critic:` section to the trainer config)")
    assert errors[4][0] == grpc.StatusCode.INVALID_ARGUMENT and "targets" in errors[4][1]
    assert version == 0


def test_calls_without_the_token_are_unauthenticated(model_dir):
    async def bare():
        settings = load_config(TrainerSettings, data={"model": {"path": model_dir}, "server": {"auth_token": TOKEN}})
        mesh, port, engine = await start(settings, "127.0.0.1:0")
        try:
            async with create_channel(f"127.0.0.1:{port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await trainer_pb2_grpc.TrainerStub(channel).GetInfo(common_pb2.GetInfoRequest())
                return err.value.code()
        finally:
            await mesh.stop(0)
            engine.close()

    assert asyncio.run(bare()) == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.slow
def test_push_weights_reaches_every_live_replica_and_reports_the_dead_one(model_dir):
    from services.rollout.config import RolloutSettings
    from services.rollout.servicer import start as start_rollout

    samples = random_samples(4, vocab_size=32)

    async def main():
        replicas = []
        for _ in range(2):
            rs = RolloutSettings(model={"path": model_dir}, server={"auth_token": TOKEN})
            replicas.append(await start_rollout(rs, "127.0.0.1:0"))
        try:
            async with trainer(model_dir) as (stub, engine):
                lp = await stub.ComputeLogProbs(sequences_pb(samples))
                for s, r in zip(samples, lp.results):
                    s.old_logprobs = list(r.logprobs)
                await stub.TrainActor(convert.train_actor_to_pb(samples, ActorLoss()))
                targets = [f"127.0.0.1:{port}" for _, port, _ in replicas] + ["127.0.0.1:1"]
                pushed = await stub.PushWeights(trainer_pb2.PushWeightsRequest(targets=targets, bucket_bytes=10_000))
                trained_lp = await stub.ComputeLogProbs(sequences_pb(samples))
                served = []
                for _, port, _ in replicas:
                    async with create_channel(f"127.0.0.1:{port}", token=TOKEN) as ch:
                        r = rollout_pb2_grpc.RolloutStub(ch)
                        info = await r.GetInfo(common_pb2.GetInfoRequest())
                        rl = await r.ComputeLogProbs(sequences_pb(samples))
                        served.append((info.weight_version, [list(x.logprobs) for x in rl.results]))
                return pushed, trained_lp, served
        finally:
            for mesh, _, replica in replicas:
                await mesh.stop(0)
                await replica.close()

    pushed, trained_lp, served = asyncio.run(main())
    assert pushed.weight_version == 1
    assert pushed.num_bytes > 0 and pushed.seconds > 0
    ok = {r.target: r.ok for r in pushed.results}
    assert list(ok.values()) == [True, True, False]
    dead = pushed.results[2]
    assert dead.target == "127.0.0.1:1" and dead.error
    expected = [list(r.logprobs) for r in trained_lp.results]
    for version, logprobs in served:
        assert version == 1
        for got, want in zip(logprobs, expected):
            assert got == pytest.approx(want, abs=1e-5)
