"""Tensor codec: torch tensors <-> (dtype, shape, raw bytes), the wire form of every tensor."""

from __future__ import annotations

import math

import torch

from meshrl.v1 import common_pb2

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def dtype_from_name(name: str, *, field: str = "dtype") -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"{field}: unknown dtype {name!r} (expected one of {sorted(DTYPES)})")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype {dtype} has no wire name")
    return DTYPE_NAMES[dtype]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw bytes of a CPU tensor without copying when it is already contiguous."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    # Reinterpreting as uint8 covers bf16, which numpy cannot represent.
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def tensor_from_bytes(data: bytes | bytearray | memoryview, dtype: torch.dtype, shape, *,
                      field: str = "tensor") -> torch.Tensor:
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"{field}.shape: negative dimension in {list(shape)}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = math.prod(shape) * itemsize
    if len(data) != expected:
        raise ValueError(f"{field}.data: {len(data)} bytes, but shape {list(shape)} of {dtype_name(dtype)} "
                         f"needs {expected}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    # bytearray copy: frombuffer needs a writable buffer and the result must own its memory.
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


def tensor_to_pb(t: torch.Tensor) -> common_pb2.Tensor:
    return common_pb2.Tensor(dtype=dtype_name(t.dtype), shape=list(t.shape), data=bytes(tensor_bytes(t)))


def tensor_from_pb(pb: common_pb2.Tensor, *, field: str = "tensor") -> torch.Tensor:
    return tensor_from_bytes(pb.data, dtype_from_name(pb.dtype, field=f"{field}.dtype"), pb.shape, field=field)
