"""Adapter-only weight sync under actor.lora (services/trainer/weights/adapter.py), real servers on port 0: a replica
that serves adapters over the trainer's base gets the adapter alone, one loaded from another base gets the frozen
base once and then adapters, one that serves no adapters gets merged weights; each ends on the trainer's policy."""

from __future__ import annotations

import asyncio
import contextlib
import json

import grpc
import pytest

from meshrl.v1 import common_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from services.common.config import load_config
from services.common.rpc.channel import create_channel
from services.trainer import convert
from services.trainer.testing import random_samples
from services.trainer.types import ActorLoss

LORA = {"rank": 4, "alpha": 8}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> tuple[str, str]:
    from services.rollout.testing import make_tiny_model

    return (make_tiny_model(tmp_path_factory.mktemp("adapter_sync_base")),
            make_tiny_model(tmp_path_factory.mktemp("adapter_sync_other"), seed=7))


@contextlib.asynccontextmanager
async def mesh(base: str, other: str):
    """A LoRA trainer on `base`; replicas: adapters on base, adapters on `other`, no adapters on base."""
    from services.rollout.config import RolloutSettings
    from services.rollout.servicer import start as start_rollout
    from services.trainer.config import TrainerSettings
    from services.trainer.servicer import start as start_trainer

    settings = load_config(TrainerSettings, data={"model": {"path": base}, "actor": {"lr": 1e-2, "lora": LORA}})
    server, port, engine = await start_trainer(settings, "127.0.0.1:0")
    replicas = []
    channel = create_channel(f"127.0.0.1:{port}")
    try:
        for path, lora in ((base, True), (other, True), (base, False)):
            rs = RolloutSettings(model={"path": path}, rollout={"enable_lora": lora})
            replicas.append(await start_rollout(rs, "127.0.0.1:0"))
        yield trainer_pb2_grpc.TrainerStub(channel), [f"127.0.0.1:{p}" for _, p, _ in replicas]
    finally:
        for m, _, replica in replicas:
            await m.stop(0)
            await replica.close()
        await channel.close()
        await server.stop(0)
        engine.close()


def logprobs_request(samples, adapter: str = "") -> common_pb2.LogProbsRequest:
    return common_pb2.LogProbsRequest(sequences=[
        common_pb2.TokenSequence(id=f"s{i}", prompt_ids=s.prompt_ids, response_ids=s.response_ids)
        for i, s in enumerate(samples)], temperature=1.0, adapter=adapter)


async def train_once(stub, samples) -> list[list[float]]:
    lp = await stub.ComputeLogProbs(logprobs_request(samples))
    for s, r in zip(samples, lp.results):
        s.old_logprobs = list(r.logprobs)
    await stub.TrainActor(convert.train_actor_to_pb(samples, ActorLoss()))
    return [list(r.logprobs) for r in (await stub.ComputeLogProbs(logprobs_request(samples))).results]


async def replica_logprobs(target: str, samples, adapter: str) -> tuple[list[list[float]], dict]:
    async with create_channel(target) as ch:
        stub = rollout_pb2_grpc.RolloutStub(ch)
        lp = await stub.ComputeLogProbs(logprobs_request(samples, adapter))
        info = await stub.GetInfo(common_pb2.GetInfoRequest())
        return [list(r.logprobs) for r in lp.results], dict(info.details)


def test_each_replica_gets_what_it_can_serve_and_ends_on_the_trainers_policy(model_dirs):
    samples = random_samples(3, vocab_size=32)

    async def main():
        rounds = []
        async with mesh(*model_dirs) as (stub, targets):
            for _ in range(2):
                await train_once(stub, samples)
                want = [list(r.logprobs) for r in (await stub.ComputeLogProbs(logprobs_request(samples))).results]
                pushed = await stub.PushWeights(trainer_pb2.PushWeightsRequest(targets=targets))
                got = [await replica_logprobs(t, samples, r.adapter) for t, r in zip(targets, pushed.results)]
                rounds.append((pushed, want, got))
            resolved = json.loads((await stub.GetInfo(common_pb2.GetInfoRequest())).details["resolved"])
        return targets, rounds, resolved

    targets, rounds, resolved = asyncio.run(main())
    for step, (pushed, want, got) in enumerate(rounds):
        assert [r.ok for r in pushed.results] == [True] * 3, [r.error for r in pushed.results]
        assert [r.adapter for r in pushed.results] == ["default", "default", ""]
        # The base goes once to the replica that held another one; after that it gets adapters like the first.
        assert [r.payload for r in pushed.results] == (["adapter", "base+adapter", "full"] if step == 0 else
                                                       ["adapter", "adapter", "full"])
        for lp, _ in got:
            for g, w in zip(lp, want, strict=True):
                assert g == pytest.approx(w, abs=1e-5)
    _, details = rounds[0][2][0]
    assert details["supports_adapters"] == "true" and json.loads(details["adapters"]) == {"default": 1}
    assert rounds[0][2][2][1]["supports_adapters"] == "false"
    assert {k: v["value"] for k, v in resolved.items() if k.startswith("weight_sync.payload[")} == {
        f"weight_sync.payload[{targets[0]}]": "adapter", f"weight_sync.payload[{targets[1]}]": "adapter",
        f"weight_sync.payload[{targets[2]}]": "full"}
    # Bytes: the first push carried merged weights, the base and the adapter; the second merged + adapter only.
    assert rounds[1][0].num_bytes < rounds[0][0].num_bytes


def test_an_adapter_update_lands_whole_on_its_own_base_or_not_at_all(model_dirs):
    from services.rollout.config import RolloutSettings
    from services.rollout.servicer import start as start_rollout
    from services.rollout.weights_client import push_weights, weight_messages
    from tests.unit.test_rollout_lora import trained_adapter

    tensors, config, _ = trained_adapter(model_dirs[0], seed=4)

    async def main():
        server, port, replica = await start_rollout(RolloutSettings(model={"path": model_dirs[0]},
                                                                    rollout={"enable_lora": True}), "127.0.0.1:0")
        try:
            async with create_channel(f"127.0.0.1:{port}") as ch:
                stub = rollout_pb2_grpc.RolloutStub(ch)
                base = (await stub.GetInfo(common_pb2.GetInfoRequest())).details["base_id"]
                errors = []
                for kw in ({"base_id": "sha256:another"}, {"base_id": base, "drop_commit": True}):
                    messages = list(weight_messages(tensors, 2, 4096, adapter="default", adapter_config=config,
                                                    base_id=kw["base_id"]))
                    if kw.get("drop_commit"):
                        messages = messages[:-1]       # a sender that stopped after its last bucket

                    async def stream(ms=messages):
                        for m in ms:
                            yield m
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await stub.UpdateWeights(stream())
                    errors.append(e.value.details())
                untouched = json.loads((await stub.GetInfo(common_pb2.GetInfoRequest())).details["adapters"])
                done = await push_weights(stub, tensors, 3, 4096, adapter="default", adapter_config=config,
                                          base_id=base)
                after = json.loads((await stub.GetInfo(common_pb2.GetInfoRequest())).details["adapters"])
                return base, errors, untouched, done.weight_version, after
        finally:
            await server.stop(0)
            await replica.close()

    base, errors, untouched, version, after = asyncio.run(main())
    assert base.startswith("sha256:")
    assert "push the base first" in errors[0] and "commit" in errors[1]
    assert untouched == {} and version == 3 and after == {"default": 3}
