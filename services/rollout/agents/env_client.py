"""The env role as the episode loop sees it: tool calls and environment episodes over a pool of env replicas.

Tool calls are stateless, so the pool (services.common.rpc.pools) retries a call that lost its replica on another one.
An environment's state lives on the replica that ran its Reset: `step` goes to that replica only, and raises
EnvLost when it is gone (UNAVAILABLE, a deadline) or forgot the episode (NOT_FOUND, e.g. it restarted); the loop
then replays the episode elsewhere or records it as env_lost (loops.py).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Sequence

import grpc

from meshrl.v1 import env_pb2, env_pb2_grpc
from services.common.config import PoolConfig
from services.common.errors import Unavailable
from services.common.rpc.pools import ReplicaPool, configured
from services.common.tool_calls import ToolCall
from services.env import convert
from services.env.types import StepResult, ToolResult

log = logging.getLogger("meshrl.rollout.env")

# Step failures that mean the episode's state is gone with its replica.
LOST = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.CANCELLED)


class EnvLost(Exception):
    """The replica that held an environment episode's state is gone or no longer knows the episode."""


class EnvClient:
    """Calls the env replicas of one pool; `homes` maps an environment episode to the replica holding its state."""

    def __init__(self, pool: ReplicaPool):
        self.pool = pool
        self.homes: dict[str, str] = {}

    @classmethod
    def from_section(cls, section: PoolConfig, *, registry=None, token: str | None = None) -> "EnvClient | None":
        """The client of the `env:` section's replicas; None when the section names none."""
        if not configured(section):
            return None
        return cls(ReplicaPool.from_section("env", env_pb2_grpc.EnvStub, section, registry=registry, token=token))

    async def _ready(self) -> None:
        if not self.pool.healthy():
            await self.pool.refresh()

    async def list_tools(self) -> list[dict]:
        """The OpenAI schemas of the tools the replicas host."""
        await self._ready()

        async def list_tools(stub):
            return await stub.ListTools(env_pb2.ListToolsRequest())

        return [json.loads(t) for t in (await self.pool.call(list_tools)).tools_json]

    async def call_tools(self, calls: Sequence[ToolCall], episode_id: str = "") -> list[ToolResult]:
        """One result per call, in order; a lost replica's calls run again on another one."""
        await self._ready()
        request = convert.calls_to_pb(calls, episode_id)

        async def call_tools(stub):
            return await stub.CallTools(request)

        return convert.results_from_pb(await self.pool.call(call_tools))

    async def reset(self, episode_id: str, environment: str, kwargs: dict[str, Any],
                    exclude: frozenset[str] = frozenset()) -> str:
        """Starts the episode's environment on a healthy replica (not one in `exclude`); its first observation."""
        await self._ready()
        try:
            rep = self.pool.pick(set(exclude))
        except Exception:  # noqa: BLE001 - the pool's "no healthy replica"
            rep = None
        if rep is None or rep.address in exclude:
            if not exclude:
                raise Unavailable(f"env pool: no healthy replica (known: {sorted(self.pool.replicas) or 'none'})")
            raise EnvLost(f"env pool: no replica left to reset episode {episode_id} on")
        request = env_pb2.ResetRequest(episode_id=episode_id, environment=environment,
                                       kwargs_json=json.dumps(kwargs, ensure_ascii=False))
        try:
            response = await rep.stub.Reset(request)
        except grpc.aio.AioRpcError as e:
            if e.code() not in LOST:
                raise
            rep.healthy = False
            raise EnvLost(f"env replica {rep.address}: Reset failed ({e.code().name})") from None
        self.homes[episode_id] = rep.address
        return response.observation

    def home(self, episode_id: str) -> str:
        return self.homes.get(episode_id, "")

    async def step(self, episode_id: str, action: str) -> StepResult:
        """The action on the replica that holds the episode; EnvLost when that replica lost it."""
        address = self.homes.get(episode_id)
        rep = self.pool.replicas.get(address or "")
        if rep is None:
            raise EnvLost(f"env replica {address or '?'} of episode {episode_id} left the pool")
        try:
            return convert.step_from_pb(await rep.stub.Step(env_pb2.StepRequest(episode_id=episode_id,
                                                                                action=action)))
        except grpc.aio.AioRpcError as e:
            if e.code() not in LOST:
                raise
            if e.code() != grpc.StatusCode.NOT_FOUND:
                rep.healthy = False
            raise EnvLost(f"env replica {rep.address}: Step of episode {episode_id} failed ({e.code().name})") \
                from None

    async def end(self, episode_id: str) -> None:
        """Drops the episode's state on its replica (best effort: a lost replica dropped it already)."""
        address = self.homes.pop(episode_id, None)
        rep = self.pool.replicas.get(address or "")
        if rep is None:
            return
        try:
            await rep.stub.EndEpisode(env_pb2.EndEpisodeRequest(episode_id=episode_id))
        except grpc.aio.AioRpcError as e:
            log.debug("env replica %s: EndEpisode %s failed (%s)", rep.address, episode_id, e.code().name)

    async def close(self) -> None:
        await self.pool.close()
        if self.pool.registry is not None:
            await self.pool.registry.close()
