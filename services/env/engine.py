"""The env engine: hosts tools and environments, runs tool calls concurrently, turns every failure into an error
observation. No gRPC here (services/env/servicer.py is the thin edge)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Sequence

from services.common.tool_calls import ToolCall
from services.env.config import ENVIRONMENTS, TOOLS, EnvSettings
from services.env.environments import EpisodeStore
from services.env.tools import UserTool, load_object
from services.env.types import StepResult, Tool, ToolError, ToolResult

log = logging.getLogger("meshrl.env")


def _builtin_tool(name: str, settings: EnvSettings) -> Tool:
    cls = load_object(TOOLS[name], f"env.builtin_tools ({name})")
    return cls(settings.env.python) if name == "python" else cls()


class EnvEngine:
    def __init__(self, settings: EnvSettings):
        cfg = settings.env
        self.settings = settings
        self.tools: dict[str, Tool] = {name: _builtin_tool(name, settings) for name in cfg.builtin_tools}
        for i, tool_cfg in enumerate(cfg.tools):
            self.tools[tool_cfg.name] = UserTool(tool_cfg, f"env.tools[{i}]", cfg.tool_timeout_s)
        classes = {name: load_object(path, f"env.environments.{name}") for name, path in
                   {**ENVIRONMENTS, **cfg.environments}.items()}
        self.episodes = EpisodeStore(classes, max_episodes=cfg.max_episodes, ttl_s=cfg.episode_ttl_s)
        self._slots = asyncio.Semaphore(cfg.max_concurrency)
        self.num_calls = 0
        self.num_errors = 0
        log.info("env hosts tools %s and environments %s", ", ".join(self.tools) or "-", ", ".join(classes))

    def list_tools(self) -> list[dict]:
        return [tool.schema() for tool in self.tools.values()]

    async def call_tools(self, calls: Sequence[ToolCall], episode_id: str = "") -> list[ToolResult]:
        """One result per call, in order; the calls run concurrently (at most env.max_concurrency at once)."""
        return list(await asyncio.gather(*[self._call(c, episode_id) for c in calls]))

    async def _call(self, call: ToolCall, episode_id: str) -> ToolResult:
        started = time.monotonic()
        tool = self.tools.get(call.name)
        if tool is None:
            error = f"unknown tool {call.name!r} (tools: {', '.join(self.tools) or 'none'})"
            return self._failed(call, error, started)
        async with self._slots:
            try:
                content = await tool(call.arguments, episode_id=episode_id)
            except ToolError as e:
                return self._failed(call, str(e), started)
            except Exception as e:  # noqa: BLE001 - a tool's exception is the model's observation, not a crash
                return self._failed(call, f"{type(e).__name__}: {e}", started)
        self.num_calls += 1
        return ToolResult(call.id, content, "", time.monotonic() - started)

    def _failed(self, call: ToolCall, error: str, started: float) -> ToolResult:
        self.num_calls += 1
        self.num_errors += 1
        return ToolResult(call.id, f"Error: {error}", error, time.monotonic() - started)

    async def reset(self, episode_id: str, environment: str, kwargs: dict[str, Any]) -> str:
        return await self.episodes.reset(episode_id, environment, kwargs)

    async def step(self, episode_id: str, action: str) -> StepResult:
        return await self.episodes.step(episode_id, action)

    async def end(self, episode_id: str) -> bool:
        return await self.episodes.end(episode_id)

    def info(self) -> dict:
        python = self.tools.get("python")
        return {"tools": ",".join(self.tools), "environments": ",".join(self.episodes.classes),
                "live_episodes": len(self.episodes.episodes), "tool_calls": self.num_calls,
                "tool_errors": self.num_errors,
                "python_sandbox": python.guarantees() if hasattr(python, "guarantees") else "off"}

    async def close(self) -> None:
        await self.episodes.close()
        for tool in self.tools.values():
            await tool.close()
