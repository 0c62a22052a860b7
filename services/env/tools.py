"""User tools (`package.module:function` with a JSON schema), loaded by services.common.plugins.load_object."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import jsonschema

from services.common.plugins import load_object  # noqa: F401 - the env service's tools and environments load here
from services.env.config import UserToolConfig
from services.env.types import ToolError


class UserTool:
    """A user function called as `fn(**arguments)` (plus `episode_id=` when it accepts it), sync functions in a
    thread. Arguments are checked against the tool's JSON schema first. A call past its timeout fails with an error
    observation; a sync function cannot be stopped, so its thread runs on (user tools are trusted code; untrusted
    code belongs in the `python` tool's sandbox)."""

    def __init__(self, cfg: UserToolConfig, where: str, default_timeout_s: float):
        self.name = cfg.name
        self.cfg = cfg
        self.timeout_s = cfg.timeout_s or default_timeout_s
        self.fn = load_object(cfg.function, f"{where}.function")
        if not callable(self.fn):
            raise ValueError(f"{where}.function: {cfg.function!r} is not callable")
        try:
            jsonschema.Draft202012Validator.check_schema(cfg.parameters)
        except jsonschema.SchemaError as e:
            raise ValueError(f"{where}.parameters: not a valid JSON schema ({e.message})") from None
        self.validator = jsonschema.Draft202012Validator(cfg.parameters)
        try:
            params = inspect.signature(self.fn).parameters
        except (TypeError, ValueError):   # some builtins have no signature
            params = {}
        self.takes_episode = "episode_id" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())

    def schema(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.cfg.description,
                                                 "parameters": self.cfg.parameters}}

    async def __call__(self, arguments: dict[str, Any], *, episode_id: str = "") -> str:
        error = next(iter(self.validator.iter_errors(arguments)), None)
        if error is not None:
            where = "arguments" + "".join(f"[{p!r}]" for p in error.absolute_path)
            raise ToolError(f"{where}: {error.message}")
        kwargs = dict(arguments, episode_id=episode_id) if self.takes_episode else dict(arguments)
        if inspect.iscoroutinefunction(self.fn):
            call = self.fn(**kwargs)
        else:
            call = asyncio.to_thread(self.fn, **kwargs)
        try:
            value = await asyncio.wait_for(call, self.timeout_s)
        except asyncio.TimeoutError:
            raise ToolError(f"timed out after {self.timeout_s:g}s") from None
        except TypeError as e:
            raise ToolError(f"arguments: {e}") from None
        return value if isinstance(value, str) else str(value)

    async def close(self) -> None:
        pass
