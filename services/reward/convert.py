"""Protobuf <-> dataclass conversions of the reward service (ScoreRequest in, ScoreResponse out)."""

from __future__ import annotations

import json
from typing import Sequence

from pydantic import ValidationError

from meshrl.v1 import reward_pb2
from services.common.config import format_validation_error
from services.common.convert import json_field
from services.common.tensors.packed import I32, as_list, field_of
from services.reward.config import ComponentConfig
from services.reward.types import ScoreItem, Scored


def extra_info_to_json(extra_info: dict | None) -> str:
    """A row's extra_info for ScoreItem.extra_info_json; values JSON cannot hold (dates, bytes) go as text."""
    return json.dumps(extra_info, default=str) if extra_info else ""


def extra_info_from_json(text: str, where: str) -> dict:
    return json_field(text, f"{where}extra_info_json")


def items_from_pb(request: reward_pb2.ScoreRequest) -> list[ScoreItem]:
    return [ScoreItem(id=it.id, prompt=it.prompt, response=it.response,
                      response_ids=as_list(field_of(it, "response_ids", I32, f"items[{i}].")),
                      ground_truth=it.ground_truth, data_source=it.data_source,
                      extra_info=extra_info_from_json(it.extra_info_json, f"items[{i}]."))
            for i, it in enumerate(request.items)]


def items_to_pb(items: Sequence[ScoreItem]) -> reward_pb2.ScoreRequest:
    return reward_pb2.ScoreRequest(items=[
        reward_pb2.ScoreItem(id=it.id, prompt=it.prompt, response=it.response, response_ids=it.response_ids,
                             ground_truth=it.ground_truth, data_source=it.data_source,
                             extra_info_json=extra_info_to_json(it.extra_info)) for it in items])


def results_to_pb(items: Sequence[ScoreItem], scored: Sequence[Scored]) -> reward_pb2.ScoreResponse:
    """A failed item goes with score 0 and its error (the error, not the score, is what a client reads)."""
    return reward_pb2.ScoreResponse(results=[
        reward_pb2.ScoreResult(id=it.id, score=0.0 if s.error else s.score, components=s.components,
                               extras=s.extras, error=s.error) for it, s in zip(items, scored)])


def results_from_pb(response: reward_pb2.ScoreResponse) -> list[Scored]:
    return [Scored(r.score, dict(r.components), dict(r.extras), r.error) for r in response.results]


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
