"""The coordinator's default pools (ListServices with no run id): the replicas its own config names.

A run brings its pools in its config; the coordinator's own `rollout:`, `reward:` and `reference:` sections
(static `servers`, `dns`, `registry`; `meshrl up` fills in the replicas it started) name the pools it
serves when no run is asked about, whether a run is active or not.
"""

from __future__ import annotations

from typing import Iterable

from coordinator.training.algorithms import STUBS
from coordinator.training.context import RunContext
from services.common.pools import ReplicaPool, configured
from meshrl.v1 import coordinator_pb2
from services.common.config import PoolConfig


class DefaultPools:
    """One ReplicaPool per role the coordinator's config names, health-checked on each listing."""

    def __init__(self, sections: dict[str, PoolConfig], *, registry=None, token: str | None = None):
        self.pools = [ReplicaPool.from_section(role, STUBS[role], s, registry=registry, token=token)
                      for role, s in sections.items() if configured(s)]

    async def refresh(self) -> list[ReplicaPool]:
        for pool in self.pools:
            await pool.refresh()
        return self.pools

    async def close(self) -> None:
        for pool in self.pools:
            await pool.close()


def replica_statuses(pools: Iterable[ReplicaPool], contexts: Iterable[RunContext]) -> list:
    """ReplicaStatus of every replica; load and weight version as the active runs' pools last saw them (a
    default pool makes no calls of its own)."""
    seen: dict[tuple[str, str], list] = {}
    for ctx in contexts:
        for pool in (ctx.rollout, ctx.reward, ctx.reference):
            for rep in (pool.replicas.values() if pool is not None else ()):
                seen.setdefault((pool.role, rep.address), []).append(rep)
    out = []
    for pool in pools:
        for rep in pool.replicas.values():
            same = {id(r): r for r in [rep, *seen.get((pool.role, rep.address), [])]}.values()  # each once
            out.append(coordinator_pb2.ReplicaStatus(
                pool=pool.role, address=rep.address, healthy=rep.healthy,
                weight_version=max(0, *(r.weight_version for r in same)), load=sum(r.load for r in same)))
    return out
