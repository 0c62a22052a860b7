"""Protobuf <-> dataclass conversions of the reward service (ScoreRequest in, ScoreResponse out)."""

from __future__ import annotations

import json
from typing import Sequence

from pydantic import ValidationError

from meshrl.v1 import reward_pb2
from services.common.config import format_validation_error
from services.common.packed import I32, as_list, field_of
from services.reward.config import ComponentConfig
from services.reward.types import ScoreItem, Scored


def items_from_pb(request: reward_pb2.ScoreRequest) -> list[ScoreItem]:
    return [ScoreItem(id=it.id, prompt=it.prompt, response=it.response,
                      response_ids=as_list(field_of(it, "response_ids", I32, f"items[{i}].")),
                      ground_truth=it.ground_truth, data_source=it.data_source) for i, it in enumerate(request.items)]


def items_to_pb(items: Sequence[ScoreItem]) -> reward_pb2.ScoreRequest:
    return reward_pb2.ScoreRequest(items=[
        reward_pb2.ScoreItem(id=it.id, prompt=it.prompt, response=it.response, response_ids=it.response_ids,
                             ground_truth=it.ground_truth, data_source=it.data_source) for it in items])


def results_to_pb(items: Sequence[ScoreItem], scored: Sequence[Scored]) -> reward_pb2.ScoreResponse:
    return reward_pb2.ScoreResponse(results=[
        reward_pb2.ScoreResult(id=it.id, score=s.score, components=s.components) for it, s in zip(items, scored)])


def results_from_pb(response: reward_pb2.ScoreResponse) -> list[Scored]:
    return [Scored(r.score, dict(r.components)) for r in response.results]


def components_to_pb(components: Sequence[ComponentConfig]) -> list[reward_pb2.RewardComponent]:
    """A run's rule components for ScoreRequest.components."""
    return [reward_pb2.RewardComponent(name=c.name, weight=c.weight, label=c.label or "",
                                       params_json=json.dumps(c.params) if c.params else "") for c in components]


def components_from_pb(request: reward_pb2.ScoreRequest) -> list[ComponentConfig] | None:
    """ScoreRequest.components as ComponentConfigs, None when the request sets none; errors name the field."""
    if not request.components:
        return None
    out = []
    for i, c in enumerate(request.components):
        try:
            params = json.loads(c.params_json) if c.params_json else {}
        except ValueError as e:
            raise ValueError(f"components[{i}].params_json: not JSON ({e})") from None
        if not isinstance(params, dict):
            raise ValueError(f"components[{i}].params_json: must be a JSON object")
        try:
            out.append(ComponentConfig(name=c.name, weight=c.weight, params=params, label=c.label or None))
        except ValidationError as e:
            raise ValueError(format_validation_error(e, f"components[{i}]")) from None
    return out
