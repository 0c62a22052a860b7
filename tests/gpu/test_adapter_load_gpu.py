"""GPU side of an adapter update's batched path (tests/unit/test_adapter_load.py on CUDA): the bank's batched load
writes its slot bit for bit as the per-layer load did (CUDA's foreach kernels and opmath, sources on the device or
on the host), and HostReceiver stages in a kept pinned buffer and hands over device tensors. Skipped without CUDA."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.rollout.weight_receivers import HostReceiver
from tests.unit.test_adapter_load import DTYPE_PAIRS, check_batched_load, stream

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("src_device", ["cuda", "cpu"])
@pytest.mark.parametrize("bank_dtype,src_dtype", DTYPE_PAIRS, ids=lambda d: str(d).removeprefix("torch."))
def test_a_batched_load_on_cuda_writes_every_slot_bit_for_bit_as_the_per_layer_load(bank_dtype, src_dtype,
                                                                                     src_device):
    check_batched_load(bank_dtype, src_dtype, device="cuda", src_device=src_device)


def test_the_host_receiver_of_a_cuda_replica_hands_over_device_tensors_from_a_kept_pinned_buffer():
    receiver = HostReceiver("cuda")
    first = {"x.lora_A.weight": torch.randn(4, 300).bfloat16(), "x.lora_B.weight": torch.randn(300, 4)}
    second = {k: v * 2 for k, v in first.items()}

    async def main():
        got = await receiver.receive(*stream(first, 1))
        assert got.buffer.is_pinned()
        assert all(t.is_cuda and torch.equal(t.cpu(), first[k]) for k, t in got.tensors.items())
        receiver.keep(got)
        again = await receiver.receive(*stream(second, 2))
        assert again.buffer.data_ptr() == got.buffer.data_ptr()
        assert all(torch.equal(t.cpu(), second[k]) for k, t in again.tensors.items())

    asyncio.run(main())
