"""Protobuf <-> dataclass conversions shared by several services (sequences and log-probs)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from meshrl.v1 import common_pb2
from services.common.tensors.packed import F32, I32, Rows, as_list, field_of, pack_f32, pack_i32, set_rows, unpack_rows


def json_field(text: str, where: str, kind: type = dict) -> Any:
    """A JSON string field holding an object (kind=dict) or a list (kind=list); "" is the empty one. Errors name the
    field (`where`)."""
    if not text:
        return kind()
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{where}: not JSON ({e})") from None
    if not isinstance(value, kind):
        raise ValueError(f"{where}: must be a JSON {'object' if kind is dict else 'list'}")
    return value


@dataclass
class SequenceBatch:
    """Token sequences to score: ids echo back; log-probs are taken over response tokens."""

    ids: list[str]
    prompts: list[list[int]]
    responses: list[list[int]]
    temperature: float = 1.0
    # The request came as columns (prompt_rows / response_rows): the answer goes back as logprob_rows.
    columnar: bool = False


def sequences_from_pb(request: common_pb2.LogProbsRequest, *, as_lists: bool = False) -> SequenceBatch:
    """Packed and columnar ids arrive as int32 arrays (what the torch paths take as they are); as_lists for
    engines that want Python lists (vLLM)."""
    temperature = request.temperature if request.temperature else 1.0
    if temperature < 0:
        raise ValueError(f"temperature: must be >= 0, got {temperature}")
    if request.HasField("prompt_rows") or request.HasField("response_rows"):
        return _sequence_columns(request, temperature, as_lists)
    prompts, responses = [], []
    for i, s in enumerate(request.sequences):
        p = field_of(s, "prompt_ids", I32, f"sequences[{i}].")
        r = field_of(s, "response_ids", I32, f"sequences[{i}].")
        prompts.append(as_list(p) if as_lists else p)
        responses.append(as_list(r) if as_lists else r)
    return SequenceBatch(ids=[s.id for s in request.sequences], prompts=prompts, responses=responses,
                         temperature=temperature)


def _sequence_columns(request: common_pb2.LogProbsRequest, temperature: float, as_lists: bool) -> SequenceBatch:
    if len(request.sequences):
        raise ValueError("sequences: set together with prompt_rows / response_rows (send one form or the other)")
    prompts = unpack_rows(request.prompt_rows, I32, "prompt_rows")
    responses = unpack_rows(request.response_rows, I32, "response_rows")
    if len(prompts) != len(responses):
        raise ValueError(f"response_rows: {len(responses)} rows for {len(prompts)} prompt_rows")
    for name, rows in (("prompt_rows", prompts), ("response_rows", responses)):
        empty = next((i for i, r in enumerate(rows) if not len(r)), None)
        if empty is not None:
            raise ValueError(f"{name}: row {empty} is empty")
    if as_lists:
        prompts = Rows([p.tolist() for p in prompts], prompts.field)
        responses = Rows([r.tolist() for r in responses], responses.field)
    return SequenceBatch(ids=[str(i) for i in range(len(prompts))], prompts=prompts, responses=responses,
                         temperature=temperature, columnar=True)


def sequences_to_pb(batch: SequenceBatch, *, packed: bool = False,
                    columnar: bool = False) -> common_pb2.LogProbsRequest:
    """packed: ids in the packed fields, and the answer asked for in packed form. columnar: the whole batch as
    two Ragged messages (the ids are then the row numbers), answered in columns too."""
    if columnar:
        request = common_pb2.LogProbsRequest(temperature=batch.temperature)
        set_rows(request.prompt_rows, batch.prompts, I32)
        set_rows(request.response_rows, batch.responses, I32)
        return request
    if packed:
        seqs = [common_pb2.TokenSequence(id=i, prompt_ids_packed=pack_i32(p), response_ids_packed=pack_i32(r))
                for i, p, r in zip(batch.ids, batch.prompts, batch.responses)]
    else:
        seqs = [common_pb2.TokenSequence(id=i, prompt_ids=p, response_ids=r)
                for i, p, r in zip(batch.ids, batch.prompts, batch.responses)]
    return common_pb2.LogProbsRequest(sequences=seqs, temperature=batch.temperature, packed=packed)


def logprobs_to_pb(ids: list[str], logprobs: list[list[float]], weight_version: int, *,
                   packed: bool = False, columnar: bool = False) -> common_pb2.LogProbsResponse:
    if columnar:
        response = common_pb2.LogProbsResponse(weight_version=weight_version)
        set_rows(response.logprob_rows, logprobs, F32)
        return response
    if packed:
        results = [common_pb2.TokenLogProbs(id=i, logprobs_packed=pack_f32(lp)) for i, lp in zip(ids, logprobs)]
    else:
        results = [common_pb2.TokenLogProbs(id=i, logprobs=lp.tolist() if hasattr(lp, "tolist") else lp)
                   for i, lp in zip(ids, logprobs)]
    return common_pb2.LogProbsResponse(results=results, weight_version=weight_version)


def logprobs_from_pb(response: common_pb2.LogProbsResponse, *, as_arrays: bool = False) -> list:
    """Lists whichever form the results came in; with as_arrays, packed and columnar results stay float32
    arrays."""
    if response.HasField("logprob_rows"):
        rows = unpack_rows(response.logprob_rows, F32, "logprob_rows")
        return rows if as_arrays else [r.tolist() for r in rows]
    out = []
    for i, r in enumerate(response.results):
        lp = field_of(r, "logprobs", F32, f"results[{i}].")
        out.append(lp if as_arrays else as_list(lp))
    return out


def info_to_pb(role: str, model: str, weight_version: int, details: dict) -> common_pb2.ServiceInfo:
    return common_pb2.ServiceInfo(role=role, model=model, weight_version=weight_version,
                                  details={k: str(v) for k, v in details.items()})
