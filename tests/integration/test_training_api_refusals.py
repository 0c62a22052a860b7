"""The training API as an outside client drives it, on real servers (a trainer with LoRA, a rollout replica):
a token id outside the vocabulary sent to Decode is refused by field, and a ForwardBackward whose caller gave up
(its deadline passed) still holds the service until the trainer finished it, so the next call runs after it, in
arrival order, and sees its gradients."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from meshrl.v1 import trainer_pb2, training_pb2, training_pb2_grpc
from tests.integration.test_training_api import training_mesh


def _client(stub) -> str:
    info = stub.CreateTrainingClient(training_pb2.CreateTrainingClientRequest(base_model="examples/arith/model",
                                                                              rank=8))
    return info.client_id


def _decode_refuses_ids_outside_the_vocabulary(stub, client_id: str) -> None:
    for bad in (-3, 100000):
        with pytest.raises(grpc.RpcError) as err:
            stub.Decode(training_pb2.DecodeRequest(client_id=client_id, ids=[training_pb2.TokenIds(ids=[1]),
                                                                              training_pb2.TokenIds(ids=[5, bad])]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(f"ids[1]: token id {bad} outside the vocabulary [0, ")


def _cancelled_forward_backward_finishes_before_the_next_call(stub, client_id: str) -> None:
    tokens = [7, 11, 14, 8, 9, 16, 12, 6, 2]
    datum = trainer_pb2.Datum(model_input=tokens[:-1], target_tokens=tokens[1:], weights=[1.0] * 8)
    big = trainer_pb2.ForwardBackwardRequest(data=[datum] * 2000, loss_fn="cross_entropy")
    with pytest.raises(grpc.RpcError) as err:
        stub.ForwardBackward(training_pb2.ClientForwardBackwardRequest(client_id=client_id, request=big),
                             timeout=0.2)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The trainer finished it (the caller's deadline does not stop it there): the step comes after it and
    # applies its gradients, instead of running first and finding none.
    step = stub.OptimStep(training_pb2.ClientOptimStepRequest(
        client_id=client_id, adam_params=trainer_pb2.AdamParams(learning_rate=1e-3)), timeout=120)
    assert step.step == 1 and step.metrics["grad_norm"] > 0


def test_an_outside_client_gets_refusals_and_order_it_can_rely_on(tmp_path):
    async def main():
        async with training_mesh(tmp_path) as (address, _):
            def drive():
                with grpc.insecure_channel(address) as channel:
                    stub = training_pb2_grpc.TrainingStub(channel)
                    client_id = _client(stub)
                    _decode_refuses_ids_outside_the_vocabulary(stub, client_id)
                    _cancelled_forward_backward_finishes_before_the_next_call(stub, client_id)
            await asyncio.to_thread(drive)

    asyncio.run(main())
