"""Replica pools for the stateless roles (rollout, reward, reference, env): discovery (static, DNS, Redis), health,
balancing, failover. The coordinator calls its roles through them; a rollout replica calls the env role.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

from services.common.rpc.channel import create_channel
from services.common.config import PoolConfig
from services.common.errors import Unavailable

log = logging.getLogger("meshrl.pools")
T = TypeVar("T")

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


def is_retryable(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in RETRYABLE or isinstance(exc, _NoReplica)


class _NoReplica(Exception):
    pass


@dataclass
class Replica:
    """One replica: its channel and stub, health, in-flight calls and the weight version it serves."""

    address: str
    channel: grpc.aio.Channel
    stub: Any
    healthy: bool = True
    load: int = 0
    weight_version: int = -1
    failures: int = 0
    # The LoRA adapter this replica serves the run's weights under (the trainer's last push said so; Generate's
    # sampling.adapter); "" = the model's own weights (full or merged).
    adapter: str = ""


def configured(section: PoolConfig) -> bool:
    """The section names replicas: a server list, a DNS name or the registry."""
    return bool(section.servers or section.dns or section.registry)


def resolve_dns(name: str) -> list[str]:
    """host:port -> one host:port per address the name resolves to (a headless Service's pods)."""
    host, _, port = name.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"dns: expected host:port, got {name!r}")
    infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    return sorted({f"[{i[4][0]}]:{port}" if ":" in i[4][0] else f"{i[4][0]}:{port}" for i in infos})


@dataclass
class ReplicaPool:
    """Replicas of one role called round-robin (or least-loaded); failed calls move to another replica."""

    role: str
    stub_factory: Callable[[grpc.aio.Channel], Any]
    servers: Sequence[str] = ()
    dns: str | None = None
    registry: Any = None                      # services.common.rpc.registry.Registry when discovery is through Redis
    load_balancer: str = "round_robin"
    timeout_s: float = 300.0
    token: str | None = None
    rejoin_wait_s: float = 0.0                # how long a call waits for a replica to come back when none is healthy
    max_attempts: int = 3
    replicas: dict[str, Replica] = field(default_factory=dict)
    _rr: itertools.count = field(default_factory=itertools.count)

    @classmethod
    def from_section(cls, role: str, stub_factory, section: PoolConfig, *, registry=None,
                     token: str | None = None) -> "ReplicaPool":
        """The pool a config section (`rollout:`, `reward:`, `reference:`) names."""
        return cls(role, stub_factory, servers=list(section.servers), dns=section.dns,
                   registry=registry if section.registry else None, load_balancer=section.load_balancer,
                   timeout_s=section.timeout_s, rejoin_wait_s=section.rejoin_wait_s, token=token)

    async def discover(self) -> list[str]:
        addresses = list(self.servers)
        if self.dns:
            addresses += await asyncio.to_thread(resolve_dns, self.dns)
        if self.registry is not None:
            addresses += await self.registry.list(self.role)
        return sorted(set(addresses))

    def _add(self, address: str) -> Replica:
        channel = create_channel(address, token=self.token, timeout=self.timeout_s, max_attempts=2)
        rep = Replica(address, channel, self.stub_factory(channel))
        self.replicas[address] = rep
        log.info("%s pool: replica %s joined", self.role, address)
        return rep

    async def refresh(self) -> list[Replica]:
        """Re-discovers replicas and health-checks each; returns the healthy ones."""
        try:
            wanted = await self.discover()
        except Exception as e:  # noqa: BLE001 - Redis or DNS down: keep the replicas we know, re-check their health
            log.warning("%s pool: discovery failed (%s: %s); keeping %d known replicas", self.role,
                        type(e).__name__, e, len(self.replicas))
            wanted = sorted(self.replicas)
        for address in wanted:
            if address not in self.replicas:
                self._add(address)
        for address in list(self.replicas):
            if address not in wanted:
                rep = self.replicas.pop(address)
                log.info("%s pool: replica %s left", self.role, address)
                await rep.channel.close()
        await asyncio.gather(*(self._check(r) for r in self.replicas.values()))
        return self.healthy()

    async def _check(self, rep: Replica) -> None:
        try:
            resp = await health_pb2_grpc.HealthStub(rep.channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                                       timeout=2.0)
            ok = resp.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            ok = False
        if ok != rep.healthy:
            log.warning("%s pool: replica %s is %s", self.role, rep.address, "healthy again" if ok else "unhealthy")
            if ok:
                # It may have restarted in between (a new process serves the initial weights): ask again.
                rep.weight_version = -1
        rep.healthy = ok

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.healthy]

    async def wait_for_replica(self) -> list[Replica]:
        """The healthy replicas, waiting up to rejoin_wait_s for one to come back (health-checked every half
        second) when none is; empty when none came back."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.rejoin_wait_s
        healthy = self.healthy() or await self.refresh()
        if not healthy and self.rejoin_wait_s:
            log.warning("%s pool: no healthy replica; waiting up to %.0fs for one to come back", self.role,
                        self.rejoin_wait_s)
        while not healthy and loop.time() < deadline:
            await asyncio.sleep(0.5)
            healthy = await self.refresh()
        return healthy

    def pick(self, exclude: set[str] = frozenset()) -> Replica:
        candidates = [r for r in self.healthy() if r.address not in exclude] or \
                     [r for r in self.healthy()]
        if not candidates:
            raise _NoReplica(f"{self.role} pool: no healthy replica")
        if self.load_balancer == "least_loaded":
            return min(candidates, key=lambda r: (r.load, r.address))
        return candidates[next(self._rr) % len(candidates)]

    async def call(self, fn: Callable[[Any], Awaitable[T]], *, prefer: Replica | None = None) -> T:
        """Runs fn(stub) on a replica; UNAVAILABLE / deadline errors retry on another one (tenacity)."""
        tried: set[str] = set()
        first = [prefer]

        async def attempt() -> T:
            if self.rejoin_wait_s and not self.healthy():
                await self.wait_for_replica()
            rep = first.pop() if first and first[0] is not None and first[0].healthy else self.pick(tried)
            first.clear()
            tried.add(rep.address)
            rep.load += 1
            try:
                return await fn(rep.stub)
            except grpc.aio.AioRpcError as e:
                if e.code() in RETRYABLE:
                    rep.healthy = False
                    rep.failures += 1
                    log.warning("%s pool: %s failed on %s (%s); retrying elsewhere", self.role,
                                getattr(fn, "__name__", "call"), rep.address, e.code().name)
                raise
            finally:
                rep.load -= 1

        try:
            async for retry in AsyncRetrying(stop=stop_after_attempt(self.max_attempts),
                                             wait=wait_exponential(multiplier=0.05, max=1.0),
                                             retry=retry_if_exception(is_retryable), reraise=True):
                with retry:
                    return await attempt()
        except _NoReplica as e:
            raise Unavailable(str(e)) from None
        raise AssertionError("unreachable")

    async def close(self) -> None:
        for rep in self.replicas.values():
            await rep.channel.close()
        self.replicas.clear()


def split_round_robin(items: Sequence[T], num_parts: int) -> list[list[T]]:
    """Contiguous, near-equal chunks so whole groups stay together on one replica."""
    num_parts = max(1, min(num_parts, len(items)))
    size, extra = divmod(len(items), num_parts)
    out, start = [], 0
    for i in range(num_parts):
        end = start + size + (1 if i < extra else 0)
        out.append(list(items[start:end]))
        start = end
    return out
