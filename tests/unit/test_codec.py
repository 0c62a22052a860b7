"""Tensor codec round trips for every dtype, bf16 included, and clear errors on bad payloads."""

import pytest
import torch

from services.common.tensors.codec import DTYPES, tensor_from_bytes, tensor_from_pb, tensor_to_pb


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_tensor_round_trips_bit_exactly_for_every_dtype(name):
    dtype = DTYPES[name]
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(3, 5, generator=g) * 50)
    t = t > 0 if dtype == torch.bool else t.to(dtype)
    back = tensor_from_pb(tensor_to_pb(t))
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))


def test_scalar_and_empty_tensors_round_trip():
    for t in (torch.tensor(3.5, dtype=torch.bfloat16), torch.empty(0, 4)):
        back = tensor_from_pb(tensor_to_pb(t))
        assert back.shape == t.shape and torch.equal(back, t)


def test_non_contiguous_tensor_is_encoded_in_row_major_order():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()
    assert torch.equal(tensor_from_pb(tensor_to_pb(t)), t)


def test_wrong_byte_count_names_the_field():
    with pytest.raises(ValueError, match="weights.data: 7 bytes"):
        tensor_from_bytes(b"\0" * 7, torch.float32, (2,), field="weights")


def test_unknown_dtype_names_the_field():
    pb = tensor_to_pb(torch.zeros(2))
    pb.dtype = "float8"
    with pytest.raises(ValueError, match="x.dtype: unknown dtype 'float8'"):
        tensor_from_pb(pb, field="x")
