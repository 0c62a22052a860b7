"""Protobuf <-> dataclass conversions of the env service (both ends use them)."""

from __future__ import annotations

from typing import Any, Sequence

from meshrl.v1 import env_pb2
from services.common.convert import json_field
from services.common.tool_calls import ToolCall
from services.env.types import StepResult, ToolResult


def json_object(text: str, where: str) -> dict[str, Any]:
    """A `*_json` field as a dict ("" = {}); errors name the field."""
    return json_field(text, where)


def calls_to_pb(calls: Sequence[ToolCall], episode_id: str = "") -> env_pb2.CallToolsRequest:
    return env_pb2.CallToolsRequest(episode_id=episode_id, calls=[
        env_pb2.ToolCall(id=c.id, name=c.name, arguments_json=c.arguments_json()) for c in calls])


def calls_from_pb(request: env_pb2.CallToolsRequest) -> list[ToolCall]:
    if not request.calls:
        raise ValueError("calls: give at least one tool call")
    return [ToolCall(name=c.name, id=c.id or f"call_{i}",
                     arguments=json_object(c.arguments_json, f"calls[{i}].arguments_json"))
            for i, c in enumerate(request.calls)]


def results_to_pb(results: Sequence[ToolResult]) -> env_pb2.CallToolsResponse:
    return env_pb2.CallToolsResponse(results=[
        env_pb2.ToolResult(id=r.id, content=r.content, error=r.error, duration_s=r.duration_s) for r in results])


def results_from_pb(response: env_pb2.CallToolsResponse) -> list[ToolResult]:
    return [ToolResult(r.id, r.content, r.error, r.duration_s) for r in response.results]


def step_to_pb(step: StepResult) -> env_pb2.StepResponse:
    return env_pb2.StepResponse(observation=step.observation, reward=step.reward, done=step.done,
                                metrics=step.metrics)


def step_from_pb(response: env_pb2.StepResponse) -> StepResult:
    return StepResult(response.observation, response.reward, response.done, dict(response.metrics))
