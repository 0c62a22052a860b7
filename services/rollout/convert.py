"""Protobuf <-> dataclass conversions of the rollout service (the only place rollout_pb2 is touched)."""

from __future__ import annotations

from meshrl.v1 import common_pb2, rollout_pb2
from services.common.packed import F32, I32, as_list, field_of, pack_f32, pack_i32, set_rows, unpack_rows
from services.common.weights import Manifest, manifest_from_kwargs
from services.rollout.config import RolloutConfig
from services.rollout.types import GenerateBatch, PromptInput, PromptResult, SampleResult, SamplingParams


def sampling_from_pb(pb: rollout_pb2.SamplingParams | None, defaults: RolloutConfig) -> SamplingParams:
    """Unset (0 / empty) fields take the replica's `rollout:` defaults, except temperature: 0 is greedy.

    With no SamplingParams message at all, every field (temperature included) is the default. Bad values are
    ValueErrors naming the field (SamplingParams checks itself), so they never reach an engine.
    """
    if pb is None:
        return defaults.sampling()
    return SamplingParams(
        n=pb.n if pb.n != 0 else defaults.n,
        temperature=pb.temperature,
        top_p=pb.top_p if pb.top_p != 0 else 1.0,
        max_tokens=pb.max_tokens if pb.max_tokens != 0 else defaults.max_tokens,
        stop=list(pb.stop) if pb.stop else list(defaults.stop),
        seed=pb.seed if pb.seed != 0 else defaults.seed)


def request_from_pb(request: rollout_pb2.GenerateRequest, defaults: RolloutConfig) -> GenerateBatch:
    sampling = request.sampling if request.HasField("sampling") else None
    return GenerateBatch(prompts=[PromptInput(id=p.id, text=p.text, prompt_ids=p.prompt_ids[:])
                                  for p in request.prompts],
                         sampling=sampling_from_pb(sampling, defaults))


def sampling_to_pb(p: SamplingParams) -> rollout_pb2.SamplingParams:
    """The wire form of `p`; top_logprobs stays behind (the HTTP API's alone) and seed None travels as 0."""
    return rollout_pb2.SamplingParams(n=p.n, temperature=p.temperature, top_p=p.top_p, max_tokens=p.max_tokens,
                                      stop=p.stop, seed=p.seed or 0)


def request_to_pb(batch: GenerateBatch) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(id=p.id, text=p.text, prompt_ids=p.prompt_ids) for p in batch.prompts],
        sampling=sampling_to_pb(batch.sampling))


def sample_to_pb(s: SampleResult, *, packed: bool = False) -> rollout_pb2.Sample:
    if packed:
        return rollout_pb2.Sample(response_ids_packed=pack_i32(s.response_ids), logprobs_packed=pack_f32(s.logprobs),
                                  text=s.text, finish_reason=s.finish_reason, weight_version=s.weight_version)
    return rollout_pb2.Sample(response_ids=s.response_ids, logprobs=s.logprobs, text=s.text,
                              finish_reason=s.finish_reason, weight_version=s.weight_version)


def results_to_pb(results: list[PromptResult], *, packed: bool = False,
                  columnar: bool = False) -> rollout_pb2.GenerateResponse:
    if columnar:
        return _results_columns(results)
    return rollout_pb2.GenerateResponse(responses=[
        rollout_pb2.RolloutResponse(prompt_id=r.prompt_id, prompt_ids=r.prompt_ids,
                                    samples=[sample_to_pb(s, packed=packed) for s in r.samples])
        for r in results])


def _results_columns(results: list[PromptResult]) -> rollout_pb2.GenerateResponse:
    """Tokens and log-probs of every sample in two Ragged messages; built in place (nesting built messages would
    copy their bytes)."""
    response = rollout_pb2.GenerateResponse()
    for r in results:
        rr = response.responses.add(prompt_id=r.prompt_id, prompt_ids=r.prompt_ids)
        for s in r.samples:
            rr.samples.add(text=s.text, finish_reason=s.finish_reason, weight_version=s.weight_version)
    set_rows(response.response_rows, [s.response_ids for r in results for s in r.samples], I32)
    set_rows(response.logprob_rows, [s.logprobs for r in results for s in r.samples], F32)
    return response


def sample_rows(response: rollout_pb2.GenerateResponse) -> tuple[list, list]:
    """(token ids, log-probs) of every sample in responses[i].samples[j] order, from whichever form the answer
    carries: read-only arrays from columns or packed fields, lists from repeated ones."""
    if not response.HasField("response_rows"):
        where = [f"responses[{i}].samples[{j}]." for i, r in enumerate(response.responses)
                 for j in range(len(r.samples))]
        samples = [s for r in response.responses for s in r.samples]
        return ([field_of(s, "response_ids", I32, w) for s, w in zip(samples, where)],
                [field_of(s, "logprobs", F32, w) for s, w in zip(samples, where)])
    ids = unpack_rows(response.response_rows, I32, "response_rows")
    logprobs = unpack_rows(response.logprob_rows, F32, "logprob_rows")
    num = sum(len(r.samples) for r in response.responses)
    if len(ids) != num or len(logprobs) != num:
        raise ValueError(f"response_rows / logprob_rows: {len(ids)} / {len(logprobs)} rows for {num} samples")
    if any(len(a) != len(b) for a, b in zip(ids, logprobs)):
        raise ValueError("logprob_rows: row lengths differ from response_rows'")
    return ids, logprobs


def results_from_pb(response: rollout_pb2.GenerateResponse) -> list[PromptResult]:
    ids, logprobs = sample_rows(response)
    k, out = 0, []
    for r in response.responses:
        samples = []
        for s in r.samples:
            samples.append(SampleResult(response_ids=as_list(ids[k]), logprobs=as_list(logprobs[k]), text=s.text,
                                        finish_reason=s.finish_reason, weight_version=s.weight_version))
            k += 1
        out.append(PromptResult(prompt_id=r.prompt_id, prompt_ids=r.prompt_ids[:], samples=samples))
    return out


def manifest_from_pb(pb: common_pb2.WeightManifest) -> Manifest:
    return manifest_from_kwargs(pb.version, pb.total_bytes, pb.tensors)


def manifest_to_pb(m: Manifest) -> common_pb2.WeightManifest:
    return common_pb2.WeightManifest(
        version=m.version, total_bytes=m.total_bytes,
        tensors=[common_pb2.TensorSpec(name=t.name, dtype=t.dtype, shape=list(t.shape), offset=t.offset,
                                       nbytes=t.nbytes) for t in m.tensors])
