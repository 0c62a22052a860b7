"""Staging a device weight push with few launches (transports ipc and nccl, services/trainer/weights/).

An adapter is hundreds of small tensors (392 at the Qwen2.5-1.5B shape, rank 16 on 7 projections: 37 MB), so a push
that copies, slices and checksums them one by one costs kernel launches and Python calls, not bytes. Here every
tensor lands in its place in the staging buffers through one `torch._foreach_copy_` per (wire dtype, source dtype)
pair, over views of the buffers made once per layout (`StagingCopy`); `DeviceStaging` keeps the plan and those views
across pushes and rebuilds them only when the layout or the buffers change; `cast_copies` snapshots a state in the
wire dtype with one foreach copy on a CUDA device. The bytes staged, and so the wire format and every bucket's
checksum, are each bucket's slices of `flat_bytes` of every tensor cast to its manifest dtype, as the per-tensor
packing before did (tests/unit/test_weight_transport_staging.py keeps it as the reference).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import torch

from services.common.tensors.codec import dtype_from_name
from services.common.tensors.weight_transport import DevicePlan, device_checksum, flat_bytes


@dataclass
class _Copy:
    """One foreach copy: views of the staging buffers and, in the same order, where each one's source comes from."""

    whole: list[int] = field(default_factory=list)                      # tensor i, whole
    parts: list[tuple[int, int, int]] = field(default_factory=list)      # elements [lo, hi) of tensor i, flattened
    raw: list[tuple[int, int, int, torch.dtype]] = field(default_factory=list)   # bytes [lo, hi) of tensor i in dtype
    views: tuple[list, list, list] = field(default_factory=lambda: ([], [], []))   # of whole, parts, raw
    dsts: list[torch.Tensor] = field(default_factory=list)

    def sources(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        srcs = [tensors[i] for i in self.whole]
        srcs += [tensors[i].reshape(-1)[lo:hi] for i, lo, hi in self.parts]
        srcs += [flat_bytes(tensors[i].to(dtype))[lo:hi] for i, lo, hi, dtype in self.raw]
        return srcs


class StagingCopy:
    """Copies the tensors a DevicePlan lays out (in the plan's order; `sources`: their dtypes, which may differ from
    the manifest's: the cast happens in the copy) into buckets `buckets` of the staging buffers, bucket k going to
    `buffers[k % len(buffers)]` from its byte 0 (one buffer per bucket, or buffers taken in turn).

    A piece that is a whole tensor goes to a view of the buffer in its shape and manifest dtype, a piece of a tensor
    cut by a bucket edge to a flat typed view; only a piece whose place is not aligned to its dtype (mixed dtypes of
    odd sizes) is copied as bytes of the tensor cast first."""

    def __init__(self, plan: DevicePlan, sources: Sequence[torch.dtype], buffers: Sequence[torch.Tensor],
                 buckets: Iterable[int]):
        metas = plan.manifest.tensors
        wire = [dtype_from_name(m.dtype, field=m.name) for m in metas]
        groups: dict[tuple, _Copy] = {}
        for k in buckets:
            buf = buffers[k % len(buffers)]
            for i, start, n, at in plan.buckets[k][2]:
                size = wire[i].itemsize
                if start % size or n % size or (buf.storage_offset() + at) % size:
                    c = groups.setdefault(("bytes",), _Copy())
                    c.raw.append((i, start, start + n, wire[i]))
                    c.views[2].append(buf[at:at + n])
                    continue
                c = groups.setdefault((wire[i], sources[i]), _Copy())
                view = buf[at:at + n].view(wire[i])
                if n == metas[i].nbytes:
                    c.whole.append(i)
                    c.views[0].append(view.view(metas[i].shape))
                else:
                    c.parts.append((i, start // size, (start + n) // size))
                    c.views[1].append(view)
        for c in groups.values():
            c.dsts = c.views[0] + c.views[1] + c.views[2]
        self.copies = list(groups.values())

    @torch.no_grad()
    def __call__(self, tensors: Sequence[torch.Tensor]) -> None:
        for c in self.copies:
            torch._foreach_copy_(c.dsts, c.sources(tensors))


class DeviceStaging:
    """What a device sender keeps across pushes: the plan of the state's layout, rebuilt only when a name, dtype,
    shape or the bucket size changed (each push gets it under its own version), and the StagingCopy of each set of
    buckets it packs, remade when the plan or the staging buffers change."""

    def __init__(self):
        self.clear()

    def plan(self, state: Mapping[str, torch.Tensor], version: int, bucket_bytes: int) -> DevicePlan:
        layout = (bucket_bytes, tuple((name, t.dtype, t.shape) for name, t in state.items()))
        if layout != self._layout:
            self._plan = DevicePlan.build(state, version, bucket_bytes)
            self._layout, self._sources, self._copies = layout, [t.dtype for t in state.values()], {}
        plan = self._plan
        if plan.manifest.version != version:
            plan = dataclasses.replace(plan, manifest=dataclasses.replace(plan.manifest, version=version))
        return plan

    def pack(self, tensors: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor], buckets: Iterable[int]) -> None:
        """Copies the tensors of the last plan()'s state (in its order) into `buckets`, bucket k into
        buffers[k % len(buffers)]."""
        if self._plan is None:
            raise RuntimeError("DeviceStaging.pack before plan()")
        held = tuple((b.data_ptr(), b.numel()) for b in buffers)
        if held != self._buffers:           # the cached views pin the old buffers: drop them
            self._buffers, self._copies = held, {}
        buckets = tuple(buckets)
        copy = self._copies.get(buckets)
        if copy is None:
            copy = self._copies[buckets] = StagingCopy(self._plan, self._sources, buffers, buckets)
        copy(tensors)

    def stage(self, tensors: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]) -> list[int]:
        """Every bucket packed into its own buffer (buffers[k] holds bucket k, sized to it) and their checksums
        (device_checksum), read back with one host sync."""
        self.pack(tensors, buffers, range(len(self._plan.buckets)))
        if not buffers:
            return []
        return torch.stack([device_checksum(b) for b in buffers]).tolist()

    def clear(self) -> None:
        """Drops the plan and the views (and with them the hold they have on the buffers)."""
        self._layout: tuple | None = None
        self._plan: DevicePlan | None = None
        self._sources: list[torch.dtype] = []
        self._buffers: tuple = ()                           # (data_ptr, numel) of the buffers the views are of
        self._copies: dict[tuple[int, ...], StagingCopy] = {}


@torch.no_grad()
def cast_copies(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """Copies of the tensors in `dtype` on `device`: what a push snapshots of the trainer's weights. On a CUDA device
    they are filled by one foreach copy per source dtype rather than a `.to()` (a kernel launch) per tensor; on the
    host a `.to()` per tensor is one call, as cheap as the empty() it would take to save it."""
    device = torch.device(device)
    if device.type != "cuda":
        return {name: t.detach().to(device, dtype=dtype, copy=True) for name, t in tensors.items()}
    srcs = list(tensors.values())
    outs = [torch.empty(t.shape, dtype=dtype, device=device) for t in srcs]
    by_dtype: dict[torch.dtype, tuple[list, list]] = {}
    for src, out in zip(srcs, outs):
        group = by_dtype.setdefault(src.dtype, ([], []))
        group[0].append(out)
        group[1].append(src)
    for dsts, group in by_dtype.values():
        torch._foreach_copy_(dsts, group)
    return dict(zip(tensors, outs))
