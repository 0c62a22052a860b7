"""Weight-update payloads: a manifest of tensors plus checksummed byte buckets, applied all-or-nothing.

The sender streams tensors bucket by bucket without building one big buffer; the receiver
assembles the payload, checks every bucket's CRC and the total length, and only then hands back
tensors whose names, dtypes and shapes the caller checks against its model before copying any.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Iterator, Mapping

import torch

from services.common.tensors.codec import dtype_from_name, dtype_name, tensor_bytes, tensor_from_bytes
# The manifest types are the wire's and light (services/common/manifest.py); re-exported for the tensor side.
from services.common.manifest import DEFAULT_BUCKET_BYTES, Manifest, TensorMeta, manifest_from_kwargs  # noqa: F401


def build_manifest(state: Mapping[str, torch.Tensor], version: int) -> Manifest:
    metas, offset = [], 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        metas.append(TensorMeta(name, dtype_name(t.dtype), tuple(t.shape), offset, nbytes))
        offset += nbytes
    return Manifest(version, tuple(metas), offset)


def iter_buckets(state: Mapping[str, torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES
                 ) -> Iterator[tuple[bytes, int]]:
    """Yields (bucket, crc32) slices of the concatenated payload, each at most bucket_bytes long."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes: must be positive, got {bucket_bytes}")
    pending = bytearray()
    for t in state.values():
        view = tensor_bytes(t)
        start = 0
        while start < len(view):
            take = min(bucket_bytes - len(pending), len(view) - start)
            pending += view[start:start + take]
            start += take
            if len(pending) == bucket_bytes:
                data = bytes(pending)
                yield data, zlib.crc32(data)
                pending.clear()
    if pending:
        data = bytes(pending)
        yield data, zlib.crc32(data)


# Layouts that checked out, and view_plan's plans, by the identity of their tensors tuple (immutable, and held here so
# the id stays its): {id: (tensors, total_bytes)}, {id: (tensors, end, plan)}. Rollout's manifest_from_pb hands each
# push of one layout the same tuple.
_CHECKED: dict[int, tuple] = {}
_PLANS: dict[int, tuple] = {}


def view_plan(tensors: tuple[TensorMeta, ...]) -> tuple[int, list[tuple]]:
    """(the furthest byte a tensor reaches, [(name, dtype name, shape, contiguous strides, offset, nbytes)] per tensor)
    of a manifest's tensors: what tensors_from_flat reads of each, made once per layout."""
    held = _PLANS.get(id(tensors))
    if held is None or held[0] is not tensors:
        if len(_PLANS) >= 8:
            _PLANS.clear()
        rows = [(m.name, m.dtype, m.shape, _contiguous_strides(m.shape), m.offset, m.nbytes) for m in tensors]
        held = (tensors, max((m.offset + m.nbytes for m in tensors), default=0), rows)
        if isinstance(tensors, tuple):          # immutable: the plan stays its plan
            _PLANS[id(tensors)] = held
    return held[1], held[2]


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for s in reversed(shape):
        strides.append(step)
        step *= max(s, 1)
    return tuple(reversed(strides))


@dataclass
class PayloadAssembler:
    """Collects buckets of one update and rebuilds its tensors once everything checked out."""

    manifest: Manifest
    _buffer: bytearray = field(default_factory=bytearray)
    num_buckets: int = 0

    def __post_init__(self):
        tensors, total = self.manifest.tensors, self.manifest.total_bytes
        held = _CHECKED.get(id(tensors))
        if held is not None and held[0] is tensors and held[1] == total:
            return                  # this very layout checked out before (rollout's manifest_from_pb reuses it)
        self._check()
        if len(_CHECKED) >= 8:
            _CHECKED.clear()
        if isinstance(tensors, tuple):
            _CHECKED[id(tensors)] = (tensors, total)

    def _check(self) -> None:
        expected, offset = 0, 0
        for i, m in enumerate(self.manifest.tensors):
            if not m.name:
                raise ValueError(f"manifest.tensors[{i}].name: empty")
            dtype = dtype_from_name(m.dtype, field=f"manifest.tensors[{i}].dtype ({m.name})")
            numel = 1
            for s in m.shape:
                if s < 0:
                    raise ValueError(f"manifest.tensors[{i}].shape ({m.name}): negative dimension")
                numel *= s
            if m.offset != offset or m.nbytes != numel * dtype.itemsize:
                raise ValueError(f"manifest.tensors[{i}] ({m.name}): offset/nbytes do not match its shape and dtype")
            offset += m.nbytes
            expected += m.nbytes
        if expected != self.manifest.total_bytes:
            raise ValueError(f"manifest.total_bytes: {self.manifest.total_bytes} but tensors add up to {expected}")
        if len({m.name for m in self.manifest.tensors}) != len(self.manifest.tensors):
            raise ValueError("manifest.tensors: duplicate tensor names")

    def add(self, data: bytes, crc32: int) -> None:
        if zlib.crc32(data) != crc32:
            raise ValueError(f"bucket {self.num_buckets}: checksum mismatch (corrupted payload)")
        if len(self._buffer) + len(data) > self.manifest.total_bytes:
            raise ValueError(f"bucket {self.num_buckets}: payload longer than manifest.total_bytes "
                             f"({self.manifest.total_bytes})")
        self._buffer += data
        self.num_buckets += 1

    def finish(self) -> dict[str, torch.Tensor]:
        if len(self._buffer) != self.manifest.total_bytes:
            raise ValueError(f"payload truncated: got {len(self._buffer)} of {self.manifest.total_bytes} bytes")
        view = memoryview(self._buffer)
        return {m.name: tensor_from_bytes(view[m.offset:m.offset + m.nbytes], dtype_from_name(m.dtype), m.shape,
                                          field=m.name)
                for m in self.manifest.tensors}


def check_against(tensors: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> None:
    """Raises ValueError naming the first tensor whose name, dtype or shape the model does not have.

    Every parameter of the model must be present: a partial update would leave mixed weights.
    """
    for name, t in tensors.items():
        if name not in expected:
            raise ValueError(f"weights: unknown tensor {name!r}")
        want = expected[name]
        if t.dtype != want.dtype:
            raise ValueError(f"weights: tensor {name!r} has dtype {dtype_name(t.dtype)}, model has "
                             f"{dtype_name(want.dtype)}")
        if tuple(t.shape) != tuple(want.shape):
            raise ValueError(f"weights: tensor {name!r} has shape {list(t.shape)}, model has {list(want.shape)}")
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise ValueError(f"weights: update lacks tensor {missing[0]!r} ({len(missing)} missing)")


def named_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a weight update carries: parameters without tied duplicates, plus persistent buffers."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        out[name] = p
    return out


@torch.no_grad()
def apply_weights(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copies checked tensors into the model's parameters (call check_against first)."""
    params = named_weights(model)
    for name, t in tensors.items():
        params[name].copy_(t.to(params[name].device))


def manifest_to_kwargs(manifest: Manifest) -> dict:
    return dict(version=manifest.version, total_bytes=manifest.total_bytes,
                tensors=[dict(name=m.name, dtype=m.dtype, shape=list(m.shape), offset=m.offset, nbytes=m.nbytes)
                         for m in manifest.tensors])


