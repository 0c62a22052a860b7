"""Packed arrays on the wire: `bytes` fields holding raw little-endian int32 / float32 next to the repeated fields.

A repeated field of 256 floats costs a few microseconds to build and again to read back in Python (one
object per element); 512 samples x several fields of them made protobuf <-> Python conversion the
largest part of the mesh's overhead. The `*_packed` fields carry the same values as one bytes object:
numpy writes them with one copy and reads them without any (np.frombuffer). Readers accept either form
(`field_of`), so clients that fill the repeated fields keep working.
"""

from __future__ import annotations

import functools
import struct
from typing import Sequence

import numpy as np

I32 = np.dtype("<i4")
F32 = np.dtype("<f4")


@functools.lru_cache(maxsize=8192)
def _struct(code: str, n: int) -> struct.Struct:
    return struct.Struct(f"<{n}{code}")


def _pack(values, code: str, dtype: np.dtype) -> bytes:
    if isinstance(values, np.ndarray):
        return values.astype(dtype, copy=False).tobytes()
    try:
        # A list: struct packs it in one C call, ~3x faster than building a numpy array first.
        return _struct(code, len(values)).pack(*values)
    except (struct.error, OverflowError):     # a value outside the type: numpy's conversion rules decide
        return np.asarray(values, dtype=dtype).tobytes()


def pack_i32(values: Sequence[int] | np.ndarray) -> bytes:
    return _pack(values, "i", I32)


def pack_f32(values: Sequence[float] | np.ndarray) -> bytes:
    return _pack(values, "f", F32)


def unpack(data: bytes, dtype: np.dtype, field: str) -> np.ndarray:
    """A read-only array over the message's bytes; a length that is not a whole number of items names the field."""
    if len(data) % dtype.itemsize:
        raise ValueError(f"{field}: {len(data)} bytes is not a whole number of {dtype.itemsize}-byte values")
    return np.frombuffer(data, dtype=dtype)


def field_of(msg, name: str, dtype: np.dtype, where: str = ""):
    """`msg.<name>_packed` as an array when set, else the repeated `msg.<name>` as a list."""
    data = getattr(msg, f"{name}_packed")
    if data:
        if len(getattr(msg, name)):
            raise ValueError(f"{where}{name}: both the repeated and the packed field are set")
        return unpack(data, dtype, f"{where}{name}_packed")
    return getattr(msg, name)[:]


def as_list(values) -> list:
    """A field_of result as a list (repeated fields already are one)."""
    return values if isinstance(values, list) else values.tolist()
