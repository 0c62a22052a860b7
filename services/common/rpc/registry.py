"""Service registry in Redis: replicas register their address with a TTL heartbeat and vanish when they stop."""

from __future__ import annotations

import asyncio
import logging
import time

from pydantic import Field

from services.common.config import MeshSettings, Section

log = logging.getLogger("meshrl.registry")

DEFAULT_PREFIX = "meshrl"


class RegistryRunSection(Section):
    """The one key of `run:` a replica reads: the Redis key prefix its deployment's coordinator uses too."""

    model_config = Section.model_config | {"extra": "ignore"}
    # Registry keys are `<redis_prefix>:services:<role>`, beside the run state (`run.redis_prefix`), so two
    # deployments sharing a Redis database never see each other's replicas.
    redis_prefix: str = Field(DEFAULT_PREFIX, min_length=1)


class RegistrySettings(MeshSettings):
    """`run.redis_prefix` from the same config, env (MESHRL_RUN__REDIS_PREFIX) and flags a service starts with."""

    run: RegistryRunSection = RegistryRunSection()


class Registry:
    """`<prefix>:services:<role>` is a sorted set of address -> expiry time; stale entries are ignored and pruned."""

    def __init__(self, url: str, *, prefix: str = DEFAULT_PREFIX, ttl_s: float = 10.0):
        import redis.asyncio as aioredis

        self._redis = aioredis.from_url(url, decode_responses=True)
        self._prefix = prefix
        self.ttl_s = ttl_s

    def _key(self, role: str) -> str:
        return f"{self._prefix}:services:{role}"

    async def register(self, role: str, address: str) -> None:
        await self._redis.zadd(self._key(role), {address: time.time() + self.ttl_s})

    async def deregister(self, role: str, address: str) -> None:
        await self._redis.zrem(self._key(role), address)

    async def list(self, role: str) -> list[str]:
        now = time.time()
        await self._redis.zremrangebyscore(self._key(role), "-inf", now)
        return sorted(await self._redis.zrangebyscore(self._key(role), now, "+inf"))

    async def heartbeat(self, role: str, address: str, stop: asyncio.Event) -> None:
        """Re-registers every ttl/3 seconds until `stop` is set; survives Redis restarts by retrying."""
        while not stop.is_set():
            try:
                await self.register(role, address)
            except Exception as e:  # noqa: BLE001 - Redis down: keep serving, re-register when it is back
                log.warning("registry heartbeat for %s %s failed: %s", role, address, e)
            try:
                await asyncio.wait_for(stop.wait(), self.ttl_s / 3)
            except asyncio.TimeoutError:
                pass
        try:
            await self.deregister(role, address)
        except Exception:  # noqa: BLE001
            pass

    async def close(self) -> None:
        await self._redis.aclose()
