"""The coordinator's default pools: the replicas its own config names, or the service registry's.

A run may bring its pools in its config; the coordinator's own `rollout:`, `reward:`, `reference:` and `trainer:`
sections (static `servers`, `dns`, `registry`; `meshrl up` and `meshrl mesh` fill in the replicas they started)
name the mesh's replicas. With a registry (`run.redis_url`), a role its config leaves empty is the replicas that
registered. They are the pools ListServices shows with no run id, and the pools a run gets for each role its
recipe lists no servers for (fill).
"""

from __future__ import annotations

from typing import Iterable

from coordinator.training.algorithms import STUBS
from coordinator.training.context import RunContext
from services.common.rpc.pools import ReplicaPool, configured
from meshrl.v1 import coordinator_pb2
from services.common.config import PoolConfig


class DefaultPools:
    """One ReplicaPool per role the mesh has, health-checked on each listing; fills a run's empty sections."""

    def __init__(self, sections: dict[str, PoolConfig], *, registry=None, token: str | None = None,
                 trainer_address: str = ""):
        self.registry = registry
        self.trainer_address = trainer_address
        if registry is not None:   # a role the config leaves empty: the replicas that registered
            sections = {role: s if configured(s) else s.model_copy(update={"registry": True})
                        for role, s in sections.items()}
        self.sections = {role: s for role, s in sections.items() if configured(s)}
        self.pools = [ReplicaPool.from_section(role, STUBS[role], s, registry=registry, token=token)
                      for role, s in self.sections.items()]

    async def fill_trainer(self, cfg):
        """The run's config with the mesh's trainer when it names none (ValueError when the mesh has none)."""
        if cfg.trainer.address:
            return cfg
        address = self.trainer_address
        if not address and self.registry is not None:
            address = next(iter(await self.registry.list("trainer")), "")
        if not address:
            raise ValueError("trainer.address: the recipe names no trainer and " + self._none_known("trainer"))
        return cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"address": address})})

    async def fill(self, cfg, required: Iterable[str], optional: Iterable[str] = ()):
        """The run's config with the mesh's replicas in each role it lists none for: `required` roles must have
        one (ValueError naming the role and how to start one), `optional` ones are filled when the mesh has them."""
        updates = {}
        for role, needed in [*((r, True) for r in required), *((r, False) for r in optional)]:
            own = getattr(cfg, role)
            if configured(own):
                continue
            default = self.sections.get(role)
            if default is not None and default.registry and not default.servers and not default.dns:
                default = default if await self.registry.list(role) else None
            if default is None:
                if needed:
                    raise ValueError(f"{role}.servers: the recipe lists no {role} replica and "
                                     + self._none_known(role))
                continue
            updates[role] = own.model_copy(update={
                "servers": list(default.servers), "dns": default.dns, "registry": default.registry,
                "rejoin_wait_s": max(own.rejoin_wait_s, default.rejoin_wait_s)})
        return cfg.model_copy(update=updates) if updates else cfg

    def _none_known(self, role: str) -> str:
        where = ("none is registered with this mesh" if self.registry is not None
                 else "this coordinator knows none (it has no service registry: run.redis_url)")
        return (f"{where}; list running ones in the recipe ({role}.servers), or start one: `meshrl mesh RECIPE` "
                f"starts every role, `meshrl serve {role} --config RECIPE --server.registry_url REDIS_URL` "
                f"one replica that registers (docs/coordinator.md, \"A mesh that stays up\")")

    async def refresh(self) -> list[ReplicaPool]:
        for pool in self.pools:
            await pool.refresh()
        return self.pools

    async def close(self) -> None:
        for pool in self.pools:
            await pool.close()


def replica_statuses(pools: Iterable[ReplicaPool], contexts: Iterable[RunContext]) -> list:
    """ReplicaStatus of every replica; load and weight version as the active runs' pools last saw them (a
    default pool makes no calls of its own): weight version -1 where none did (no active run has called it since
    it joined, or a reward replica, which holds no weights), not a version 0 it may not serve."""
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
                weight_version=max(r.weight_version for r in same), load=sum(r.load for r in same)))
    return out
