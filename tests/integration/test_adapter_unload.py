"""Deleting a named adapter on the trainer frees its slot on the rollout replicas it was pushed to (rollout
UnloadAdapter, services/trainer/weights/adapter.py unload): with rollout.max_loras = 1, a second adapter is refused
until the first one is deleted (directly, or by closing its training client), then lands; real servers on port 0."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from meshrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from services.common.config import load_config
from services.common.rpc.channel import create_channel
from services.trainer.testing import random_samples
from tests.integration.test_adapter_sync import logprobs_request


async def _adapters(stub) -> dict:
    import json

    info = await stub.GetInfo(common_pb2.GetInfoRequest())
    return json.loads(info.details["adapters"])


def test_deleting_an_adapter_on_the_trainer_frees_its_slot_on_the_replicas(tmp_path):
    from services.rollout.config import RolloutSettings
    from services.rollout.servicer import start as start_rollout
    from services.rollout.testing import make_tiny_model
    from services.trainer.config import TrainerSettings
    from services.trainer.servicer import start as start_trainer

    model = make_tiny_model(tmp_path / "model")
    samples = random_samples(2, vocab_size=32)

    async def main():
        settings = load_config(TrainerSettings, data={"model": {"path": model}, "actor": {"lora": {"rank": 4}}})
        server, port, engine = await start_trainer(settings, "127.0.0.1:0")
        rs = RolloutSettings(model={"path": model}, rollout={"enable_lora": True, "max_loras": 1})
        r_server, r_port, replica = await start_rollout(rs, "127.0.0.1:0")
        target = f"127.0.0.1:{r_port}"
        try:
            async with create_channel(f"127.0.0.1:{port}") as ch, create_channel(target) as rch:
                trainer = trainer_pb2_grpc.TrainerStub(ch)
                rollout = rollout_pb2_grpc.RolloutStub(rch)
                for name in ("a", "b"):
                    await trainer.CreateAdapter(trainer_pb2.AdapterRequest(name=name))
                first = await trainer.PushWeights(trainer_pb2.PushWeightsRequest(targets=[target], adapter="a"))
                assert first.results[0].ok, first.results[0].error
                assert await _adapters(rollout) == {"a": 0}
                full = await trainer.PushWeights(trainer_pb2.PushWeightsRequest(targets=[target], adapter="b"))
                assert not full.results[0].ok and "rollout.max_loras = 1" in full.results[0].error
                deleted = await trainer.DeleteAdapter(trainer_pb2.AdapterRequest(name="a"))
                assert dict(deleted.unloaded) == {target: "unloaded"} and "a" not in deleted.adapters
                assert await _adapters(rollout) == {}
                with pytest.raises(grpc.aio.AioRpcError, match="'a' is not loaded on this replica"):
                    await rollout.ComputeLogProbs(logprobs_request(samples, "a"))
                second = await trainer.PushWeights(trainer_pb2.PushWeightsRequest(targets=[target], adapter="b"))
                assert second.results[0].ok, second.results[0].error
                assert await _adapters(rollout) == {"b": 0}
                # Under b the replica scores like the trainer's b (the freed slot was reused cleanly).
                got = await rollout.ComputeLogProbs(logprobs_request(samples, "b"))
                want = await trainer.ComputeLogProbs(logprobs_request(samples, "b"))
                for g, w in zip(got.results, want.results, strict=True):
                    assert list(g.logprobs) == pytest.approx(list(w.logprobs), abs=1e-5)
                # Unloading again is harmless and says so.
                again = await rollout.UnloadAdapter(rollout_pb2.UnloadAdapterRequest(name="a"))
                assert not again.unloaded and list(again.adapters) == ["b"]
        finally:
            await r_server.stop(0)
            await replica.close()
            await server.stop(0)
            engine.close()

    asyncio.run(main())


def test_a_replica_serving_no_adapters_refuses_unload_by_name(tmp_path):
    from services.rollout.config import RolloutSettings
    from services.rollout.servicer import start as start_rollout
    from services.rollout.testing import make_tiny_model

    async def main():
        rs = RolloutSettings(model={"path": make_tiny_model(tmp_path / "m")}, rollout={"enable_lora": False})
        server, port, replica = await start_rollout(rs, "127.0.0.1:0")
        try:
            async with create_channel(f"127.0.0.1:{port}") as ch:
                with pytest.raises(grpc.aio.AioRpcError, match="UnloadAdapter: the torch engine serves no") as e:
                    await rollout_pb2_grpc.RolloutStub(ch).UnloadAdapter(rollout_pb2.UnloadAdapterRequest(name="a"))
                assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        finally:
            await server.stop(0)
            await replica.close()

    asyncio.run(main())


def _two_clients_one_slot(address: str) -> list[float]:
    from services.training_api.client import ModelInput, SamplingParams, ServiceClient
    from tests.integration.test_training_api_clients import BASE, _course, _datums

    service = ServiceClient(address)
    a = service.create_lora_training_client(base_model=BASE, rank=8)
    b = service.create_lora_training_client(base_model=BASE, rank=8)
    assert (a.info.adapter, b.info.adapter) == ("client-0", "client-1")
    tok = a.get_tokenizer()
    prompt = ModelInput.from_ints(tok.encode("1+1="))
    _course(a, _datums(tok, ["12+30=42", "7+8=15"]), 1)
    _course(b, _datums(tok, ["99+1=100", "3+3=6"]), 1)
    a.sample(prompt, 1, SamplingParams(max_tokens=2)).result()        # client-0 takes the replica's one slot
    a.close()                                                        # ... and gives it back
    out = b.sample(prompt, 1, SamplingParams(max_tokens=2, seed=1)).result()
    b.close()
    service.close()
    return out.sequences[0].logprobs


def test_a_closed_training_clients_adapter_leaves_the_replica_so_the_next_client_fits(tmp_path):
    """rollout.max_loras 1, two training clients: the second samples once the first closed (its adapter unloaded);
    without UnloadAdapter the replica would refuse client-1 as adapter 2 of 1."""
    import copy

    from services.local import start_local_mesh
    from services.training_api.config import TrainingSettings
    from services.training_api.servicer import start as start_training
    from tests.integration.test_training_api import RECIPE

    async def main():
        recipe = copy.deepcopy(RECIPE)
        recipe["training_api"] = {"state_dir": str(tmp_path / "states")}
        recipe["rollout"]["max_loras"] = 1
        mesh = await start_local_mesh(recipe, num_rollout=1, num_reward=0, num_reference=0)
        server, port, engine = await start_training(load_config(TrainingSettings, data=mesh.config), "127.0.0.1:0")
        try:
            logprobs = await asyncio.to_thread(_two_clients_one_slot, f"127.0.0.1:{port}")
            async with create_channel(mesh.addresses["rollout"][0]) as ch:
                left = await _adapters(rollout_pb2_grpc.RolloutStub(ch))
        finally:
            await server.stop(0)
            await engine.close()
            await mesh.stop()
        return logprobs, left

    logprobs, left = asyncio.run(main())
    assert len(logprobs) >= 1
    assert left == {}              # both clients closed: no adapter left on the replica
