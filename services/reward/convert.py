"""Protobuf <-> dataclass conversions of the reward service (ScoreRequest in, ScoreResponse out)."""

from __future__ import annotations

from typing import Sequence

from meshrl.v1 import reward_pb2
from services.common.packed import I32, as_list, field_of
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
