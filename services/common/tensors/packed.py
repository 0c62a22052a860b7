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


def row_lengths_of(rows: Sequence) -> np.ndarray:
    return np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))


def set_rows(ragged, rows: Sequence, dtype: np.dtype) -> None:
    """Fills a Ragged message in place (assigning bytes to a message's own field copies nothing; nesting a built
    message copies them all): rows of numpy arrays concatenate in one copy, lists go through one struct call
    per row."""
    ragged.lengths = row_lengths_of(rows).astype(I32).tobytes()
    ragged.values = concat(rows, dtype)


def concat(rows: Sequence, dtype: np.dtype) -> bytes:
    """Every row's values one after another, as packed dtype bytes."""
    if len(rows) and isinstance(rows[0], np.ndarray):
        return np.concatenate(rows).astype(dtype, copy=False).tobytes()   # numpy converts any list among them
    code = "i" if dtype == I32 else "f"
    return b"".join(_pack(r, code, dtype) for r in rows)


def row_lengths(data: bytes, field: str) -> np.ndarray:
    """The lengths of a Ragged message (non-negative int32), as int64 for offset arithmetic."""
    lengths = unpack(data, I32, f"{field}.lengths")
    if len(lengths) and int(lengths.min()) < 0:
        raise ValueError(f"{field}.lengths: row {int(np.argmin(lengths))} has a negative length "
                         f"({int(lengths.min())})")
    return lengths.astype(np.int64)


def split_rows(values: np.ndarray, lengths: np.ndarray, field: str) -> list[np.ndarray]:
    """Rows of `lengths` over `values` (an unpack result: views); a total that differs from the lengths' sum names
    the field."""
    total = int(lengths.sum())
    if len(values) != total:
        raise ValueError(f"{field}: {len(values)} values, but the rows' lengths add up to {total}")
    ends = np.cumsum(lengths).tolist()
    out, start = [], 0
    for end in ends:
        out.append(values[start:end])
        start = end
    return out


class Rows(list):
    """The rows of a Ragged field, remembering its name: a check that finds row i bad names `field: row i`
    (services.common.tensors.modeling.validate_sequences) instead of a field the request did not use."""

    def __init__(self, rows, field: str):
        super().__init__(rows)
        self.field = field


def unpack_rows(msg, dtype: np.dtype, field: str) -> Rows:
    """The rows of a Ragged message as read-only arrays."""
    return Rows(split_rows(unpack(msg.values, dtype, f"{field}.values"), row_lengths(msg.lengths, field),
                           f"{field}.values"), field)
