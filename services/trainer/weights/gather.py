"""The actor's full weights on one rank per pipeline stage, without a full gather on every rank.

Each pipeline stage's sender (its rank at dp = tp = 0) needs every weight of the stage in full; no other
rank does. Weights are cut into buckets (in the sync dtype); for each bucket every rank of the stage packs
the local shards the sender lacks into one flat buffer and a single `dist.gather` brings them to the
sender, which places each shard where DTensor's own sharding arithmetic says it belongs (Shard and FSDP's
_StridedShard over TP alike). Ranks that hold only replicas of the sender's data (a Replicate mesh axis at
a non-zero coordinate, DDP copies, another TP coordinate's copy of a DP-only norm weight) send nothing.
A rank other than a sender holds one bucket of its own shards at a time, never the model.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch
import torch.distributed as dist


def _coordinate(mesh, rank: int) -> list[int] | None:
    where = (mesh.mesh == rank).nonzero()
    return where[0].tolist() if len(where) else None


def _contributes(t: torch.Tensor, rank: int, sender: int) -> bool:
    """Whether `rank`'s shard of DTensor `t` (as the sender's mesh sees it) is part of the sender's copy."""
    coord = _coordinate(t.device_mesh, rank)
    if coord is None or _coordinate(t.device_mesh, sender) is None:
        return False
    return all(c == 0 for c, p in zip(coord, t.placements) if p.is_replicate())


def _indices(t: torch.Tensor, coord: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """Broadcastable index tensors of the global positions that the shard at mesh `coord` holds."""
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets

    shape = list(t.shape)
    offsets: dict[int, torch.Tensor] = {}
    for mesh_dim, p in enumerate(t.placements):
        if p.is_replicate() or p.is_partial():
            continue
        size, index = _get_shard_size_and_offsets(shape[p.dim], t.device_mesh.size(mesh_dim), coord[mesh_dim], p,
                                                  offsets.get(p.dim), t.shape[p.dim], False)
        shape[p.dim] = size
        offsets[p.dim] = index[:size]
    out = []
    for d, n in enumerate(t.shape):
        idx = offsets.get(d, torch.arange(n))
        out.append(idx.view([-1 if i == d else 1 for i in range(t.dim())]))
    return tuple(out)


def _local_numel(t: torch.Tensor, coord: Sequence[int]) -> int:
    n = 1
    for idx in _indices(t, coord):
        n *= idx.numel()
    return n


def _buckets(names: Sequence[str], sizes: Sequence[int], bucket_bytes: int) -> Iterator[list[str]]:
    bucket, used = [], 0
    for name, nbytes in zip(names, sizes):
        if bucket and used + nbytes > bucket_bytes:
            yield bucket
            bucket, used = [], 0
        bucket.append(name)
        used += nbytes
    if bucket:
        yield bucket


class StageGatherer:
    """Bucketed gathers of one pipeline stage's weights to its sender. Every rank of the stage calls `gather`
    with the same weight layout; the sender gets {name: full tensor}, the others None."""

    def __init__(self, stage_ranks: Sequence[int], group):
        self.ranks, self.group = list(stage_ranks), group
        self.sender = self.ranks[0]
        self.rank = dist.get_rank()

    def gather(self, weights: dict[str, torch.Tensor], *, dtype: torch.dtype, where, bucket_bytes: int
               ) -> dict[str, torch.Tensor] | None:
        """`weights`: this rank's weights by name (the same names in the same order on every rank)."""
        names = list(weights)
        size = torch.empty((), dtype=dtype).element_size()
        out: dict[str, torch.Tensor] | None = {} if self.rank == self.sender else None
        for bucket in _buckets(names, [weights[n].numel() * size for n in names], bucket_bytes):
            part = self._gather_bucket({n: weights[n] for n in bucket}, dtype, where)
            if out is not None:
                out.update(part)
        return out

    def _parts(self, bucket: dict[str, torch.Tensor], rank: int) -> list[tuple[str, int]]:
        """(name, numel) of what `rank` sends in this bucket; any rank can work it out for any rank."""
        return [(n, _local_numel(t, _coordinate(t.device_mesh, rank))) for n, t in bucket.items()
                if hasattr(t, "placements") and _contributes(t, rank, self.sender)]

    @torch.no_grad()
    def _gather_bucket(self, bucket: dict[str, torch.Tensor], dtype: torch.dtype, where) -> dict[str, torch.Tensor]:
        sharded = {n: t for n, t in bucket.items() if hasattr(t, "placements") and len(self.ranks) > 1}
        plain = {n: t for n, t in bucket.items() if n not in sharded}
        result: dict[str, torch.Tensor] = {}
        if self.rank == self.sender:
            result = {n: t.to_local() if hasattr(t, "to_local") else t for n, t in plain.items()}
            result = {n: t.detach().to(where, dtype=dtype, copy=True) for n, t in result.items()}
        if not sharded:
            return result
        # Each rank sees its own DTensors' meshes: a rank off the sender's mesh (another TP coordinate's copy
        # of a DP-only weight) sends nothing for them. The width is the same everywhere: the first shard of
        # every weight is its largest.
        parts = {r: self._parts(sharded, r) for r in (self.ranks if self.rank == self.sender else [self.rank])}
        width = sum(_local_numel(t, [0] * t.device_mesh.ndim) for t in sharded.values())
        device = next(iter(sharded.values())).to_local().device
        mine = [sharded[n].to_local().detach().reshape(-1).to(dtype) for n, _ in parts[self.rank]]
        flat = torch.zeros(width, dtype=dtype, device=device)
        if mine:
            torch.cat(mine, out=flat[:sum(m.numel() for m in mine)])
        gathered = [torch.empty_like(flat) for _ in self.ranks] if self.rank == self.sender else None
        dist.gather(flat, gathered, group_dst=0, group=self.group)
        if self.rank != self.sender:
            return result
        full = {n: torch.empty(t.shape, dtype=dtype, device=device) for n, t in sharded.items()}
        for r, buf in zip(self.ranks, gathered):
            start = 0
            for n, k in parts[r]:
                t = sharded[n]
                index = _indices(t, _coordinate(t.device_mesh, r))
                full[n][index] = buf[start:start + k].view(torch.broadcast_shapes(*(i.shape for i in index)))
                start += k
        result.update({n: v.to(where) for n, v in full.items()})
        return {n: result[n] for n in bucket}


def stage_gatherers(mesh) -> StageGatherer:
    """This rank's StageGatherer; every rank creates every stage's group, in order (a collective)."""
    ranks = mesh.mesh                                                      # [pp, dp, tp] global ranks
    mine = None
    for s in range(ranks.shape[0]):
        stage = ranks[s].flatten().tolist()
        group = dist.new_group(stage) if len(stage) > 1 else None
        if dist.get_rank() in stage:
            mine = StageGatherer(stage, group)
    return mine
