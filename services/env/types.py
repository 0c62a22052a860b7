"""What the env service takes and gives: tool results, environment steps, and the tool and environment interfaces.

A tool call is `services.common.tool_calls.ToolCall` (name, arguments, id), the same class the parser returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class ToolResult:
    """What one call gave: the observation text, why it failed ("" = it ran), and its wall seconds."""

    id: str
    content: str
    error: str = ""
    duration_s: float = 0.0


@dataclass
class StepResult:
    """An environment's answer to one action: observation, reward, whether the episode is over, metrics."""

    observation: str
    reward: float = 0.0
    done: bool = False
    metrics: dict[str, float] = field(default_factory=dict)


class ToolError(Exception):
    """A tool ran but failed in a way the model should read (bad arguments, a limit hit): becomes ToolResult.error."""


class Tool(Protocol):
    """A hosted tool: its OpenAI schema and an async call. Raises ToolError (or anything) to fail the call."""

    name: str

    def schema(self) -> dict: ...

    async def __call__(self, arguments: dict[str, Any], *, episode_id: str = "") -> str: ...

    async def close(self) -> None: ...


class Environment(Protocol):
    """A text environment, one instance per episode. Methods may be sync or async; `close` is optional."""

    def reset(self, **kwargs: Any) -> str: ...

    def step(self, action: str) -> StepResult | tuple: ...
