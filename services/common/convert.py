"""Protobuf <-> dataclass conversions shared by several services (sequences and log-probs)."""

from __future__ import annotations

from dataclasses import dataclass

from meshrl.v1 import common_pb2


@dataclass
class SequenceBatch:
    """Token sequences to score: ids echo back; log-probs are taken over response tokens."""

    ids: list[str]
    prompts: list[list[int]]
    responses: list[list[int]]
    temperature: float = 1.0


def sequences_from_pb(request: common_pb2.LogProbsRequest) -> SequenceBatch:
    temperature = request.temperature if request.temperature else 1.0
    if temperature < 0:
        raise ValueError(f"temperature: must be >= 0, got {temperature}")
    return SequenceBatch(ids=[s.id for s in request.sequences],
                         prompts=[s.prompt_ids[:] for s in request.sequences],
                         responses=[s.response_ids[:] for s in request.sequences],
                         temperature=temperature)


def sequences_to_pb(batch: SequenceBatch) -> common_pb2.LogProbsRequest:
    return common_pb2.LogProbsRequest(
        sequences=[common_pb2.TokenSequence(id=i, prompt_ids=p, response_ids=r)
                   for i, p, r in zip(batch.ids, batch.prompts, batch.responses)],
        temperature=batch.temperature)


def logprobs_to_pb(ids: list[str], logprobs: list[list[float]], weight_version: int) -> common_pb2.LogProbsResponse:
    return common_pb2.LogProbsResponse(
        results=[common_pb2.TokenLogProbs(id=i, logprobs=lp) for i, lp in zip(ids, logprobs)],
        weight_version=weight_version)


def logprobs_from_pb(response: common_pb2.LogProbsResponse) -> list[list[float]]:
    return [r.logprobs[:] for r in response.results]


def info_to_pb(role: str, model: str, weight_version: int, details: dict) -> common_pb2.ServiceInfo:
    return common_pb2.ServiceInfo(role=role, model=model, weight_version=weight_version,
                                  details={k: str(v) for k, v in details.items()})
