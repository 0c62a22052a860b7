"""Protobuf <-> dataclass conversions of the rollout service (the only place rollout_pb2 is touched)."""

from __future__ import annotations

import functools
import json

from meshrl.v1 import common_pb2, rollout_pb2
from services.common.convert import json_field
from services.common.tensors.packed import F32, I32, as_list, field_of, pack_f32, pack_i32, set_rows, unpack_rows
from services.common.manifest import Manifest, TensorMeta, manifest_from_kwargs
from services.rollout.config import AgentConfig, RolloutConfig
from services.rollout.types import (Episode, EpisodeGroup, EpisodePrompt, GenerateBatch, PromptInput, PromptResult,
                                    SampleResult, SamplingParams)


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
        seed=pb.seed if pb.seed != 0 else defaults.seed,
        adapter=pb.adapter)


def request_from_pb(request: rollout_pb2.GenerateRequest, defaults: RolloutConfig) -> GenerateBatch:
    sampling = request.sampling if request.HasField("sampling") else None
    return GenerateBatch(prompts=[PromptInput(id=p.id, text=p.text, prompt_ids=p.prompt_ids[:])
                                  for p in request.prompts],
                         sampling=sampling_from_pb(sampling, defaults),
                         partial_rollout=request.partial_rollout or "off")


def sampling_to_pb(p: SamplingParams) -> rollout_pb2.SamplingParams:
    """The wire form of `p`; top_logprobs stays behind (the HTTP API's alone) and seed None travels as 0."""
    return rollout_pb2.SamplingParams(n=p.n, temperature=p.temperature, top_p=p.top_p, max_tokens=p.max_tokens,
                                      stop=p.stop, seed=p.seed or 0, adapter=p.adapter)


def request_to_pb(batch: GenerateBatch) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(id=p.id, text=p.text, prompt_ids=p.prompt_ids) for p in batch.prompts],
        sampling=sampling_to_pb(batch.sampling), partial_rollout=batch.partial_rollout)


def sample_to_pb(s: SampleResult, *, packed: bool = False) -> rollout_pb2.Sample:
    if packed:
        return rollout_pb2.Sample(response_ids_packed=pack_i32(s.response_ids), logprobs_packed=pack_f32(s.logprobs),
                                  text=s.text, finish_reason=s.finish_reason, weight_version=s.weight_version,
                                  weight_versions=s.weight_versions or [], cached_prompt_tokens=s.cached_prompt_tokens)
    return rollout_pb2.Sample(response_ids=s.response_ids, logprobs=s.logprobs, text=s.text,
                              finish_reason=s.finish_reason, weight_version=s.weight_version,
                              weight_versions=s.weight_versions or [], cached_prompt_tokens=s.cached_prompt_tokens)


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
            rr.samples.add(text=s.text, finish_reason=s.finish_reason, weight_version=s.weight_version,
                           weight_versions=s.weight_versions or [], cached_prompt_tokens=s.cached_prompt_tokens)
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


def token_versions(s: rollout_pb2.Sample, num_tokens: int, where: str) -> list[int] | None:
    """A sample's per-token weight versions (None: every token is weight_version's); a list that does not match
    its tokens, or holds a version below weight_version (the oldest), is a ValueError naming the field."""
    if not s.weight_versions:
        return None
    versions = s.weight_versions[:]
    if len(versions) != num_tokens or min(versions) != s.weight_version:
        raise ValueError(f"{where}.samples.weight_versions: {len(versions)} versions (oldest {min(versions)}) for "
                         f"{num_tokens} tokens of weight_version {s.weight_version}")
    return versions


def results_from_pb(response: rollout_pb2.GenerateResponse) -> list[PromptResult]:
    ids, logprobs = sample_rows(response)
    k, out = 0, []
    for i, r in enumerate(response.responses):
        samples = []
        for s in r.samples:
            samples.append(SampleResult(response_ids=as_list(ids[k]), logprobs=as_list(logprobs[k]), text=s.text,
                                        finish_reason=s.finish_reason, weight_version=s.weight_version,
                                        weight_versions=token_versions(s, len(ids[k]), f"responses[{i}]"),
                                        cached_prompt_tokens=s.cached_prompt_tokens))
            k += 1
        out.append(PromptResult(prompt_id=r.prompt_id, prompt_ids=r.prompt_ids[:], samples=samples))
    return out


def manifest_from_pb(pb: common_pb2.WeightManifest) -> Manifest:
    """The update's manifest; its tensor specs converted once per layout, found by their wire bytes (converting an
    adapter's 392 specs took about a millisecond of every push, and each push of a run sends the same ones)."""
    specs = common_pb2.WeightManifest()
    specs.CopyFrom(pb)
    for f, _ in pb.ListFields():
        if f.name != "tensors":
            specs.ClearField(f.name)
    return Manifest(int(pb.version), _tensor_metas(specs.SerializeToString()), int(pb.total_bytes),
                    adapter=pb.adapter, adapter_config=pb.adapter_config, base_id=pb.base_id)


@functools.lru_cache(maxsize=8)
def _tensor_metas(specs: bytes) -> tuple[TensorMeta, ...]:
    """The TensorMetas of a WeightManifest holding tensor specs only, given as its bytes."""
    return manifest_from_kwargs(0, 0, common_pb2.WeightManifest.FromString(specs).tensors).tensors


def manifest_to_pb(m: Manifest) -> common_pb2.WeightManifest:
    return common_pb2.WeightManifest(
        version=m.version, total_bytes=m.total_bytes, adapter=m.adapter, adapter_config=m.adapter_config,
        base_id=m.base_id,
        tensors=[common_pb2.TensorSpec(name=t.name, dtype=t.dtype, shape=list(t.shape), offset=t.offset,
                                       nbytes=t.nbytes) for t in m.tensors])


# ---- GenerateEpisodes


def agent_to_pb(agent: AgentConfig) -> rollout_pb2.AgentSpec:
    return rollout_pb2.AgentSpec(
        name=agent.name or "", max_turns=agent.max_turns, max_total_tokens=agent.max_total_tokens,
        max_tokens_per_turn=agent.max_tokens_per_turn or 0, tools=agent.tools,
        tool_call_parser=agent.tool_call_parser or "", tool_error_policy=agent.tool_error_policy,
        environment=agent.environment or "", environment_deterministic=agent.environment_deterministic,
        program=agent.program or "")


def agent_from_pb(pb: rollout_pb2.AgentSpec, defaults: AgentConfig) -> AgentConfig:
    """Unset (0 / empty) fields take the replica's `rollout.agent:` values; bad values are ValueErrors naming the
    key (the section's own checks)."""
    given = {"name": pb.name, "max_turns": pb.max_turns, "max_total_tokens": pb.max_total_tokens,
             "max_tokens_per_turn": pb.max_tokens_per_turn, "tools": list(pb.tools),
             "tool_call_parser": pb.tool_call_parser, "tool_error_policy": pb.tool_error_policy,
             "environment": pb.environment, "program": pb.program}
    update = {k: v for k, v in given.items() if v}
    if pb.HasField("environment_deterministic"):
        update["environment_deterministic"] = pb.environment_deterministic
    try:
        return AgentConfig.model_validate({**defaults.model_dump(), **update})
    except Exception as e:  # pydantic's ValidationError: one line naming the key
        errors = getattr(e, "errors", lambda: [])()
        if errors:
            first = errors[0]
            raise ValueError(f"agent.{'.'.join(map(str, first['loc']))}: {first['msg']}") from None
        raise


def episode_prompts_from_pb(request: rollout_pb2.GenerateEpisodesRequest) -> list[EpisodePrompt]:
    out = []
    for i, p in enumerate(request.prompts):
        messages = json_field(p.messages_json, f"prompts[{i}].messages_json", list)
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise ValueError(f"prompts[{i}].messages_json: every message needs a role")
        out.append(EpisodePrompt(id=p.id, text=p.text, prompt_ids=p.prompt_ids[:], messages=messages,
                                 agent_name=p.agent_name,
                                 tools_kwargs=json_field(p.tools_kwargs_json, f"prompts[{i}].tools_kwargs_json",
                                                          dict)))
    return out


def episodes_request_to_pb(prompts: list[EpisodePrompt], sampling: SamplingParams, agent: AgentConfig,
                           partial_rollout: str = "off") -> rollout_pb2.GenerateEpisodesRequest:
    return rollout_pb2.GenerateEpisodesRequest(
        prompts=[rollout_pb2.EpisodePrompt(
            id=p.id, text=p.text, prompt_ids=p.prompt_ids,
            messages_json=json.dumps(p.messages, ensure_ascii=False) if p.messages else "",
            agent_name=p.agent_name,
            tools_kwargs_json=json.dumps(p.tools_kwargs, ensure_ascii=False) if p.tools_kwargs else "")
            for p in prompts],
        sampling=sampling_to_pb(sampling), agent=agent_to_pb(agent), partial_rollout=partial_rollout)


def episodes_to_pb(groups: list[EpisodeGroup]) -> rollout_pb2.GenerateEpisodesResponse:
    """Every episode's tokens as four columns (rows in groups[i].episodes[j] order); built in place."""
    response = rollout_pb2.GenerateEpisodesResponse()
    episodes = [e for g in groups for e in g.episodes]
    for g in groups:
        first = g.episodes[0].prompt_ids if g.episodes else []
        group = response.groups.add(prompt_id=g.prompt_id, prompt_ids=first)
        for e in g.episodes:
            info = group.episodes.add(text=e.text, end_reason=e.end_reason, num_turns=e.num_turns,
                                      num_tool_calls=e.num_tool_calls, num_tool_errors=e.num_tool_errors,
                                      prompt_ids=e.prompt_ids if e.prompt_ids != first else [])
            if e.env_reward is not None:
                info.env_reward = e.env_reward
            info.env_metrics.update(e.env_metrics)
    set_rows(response.response_rows, [e.response_ids for e in episodes], I32)
    set_rows(response.logprob_rows, [e.logprobs for e in episodes], F32)
    set_rows(response.loss_mask_rows, [e.loss_mask for e in episodes], I32)
    set_rows(response.version_rows, [e.weight_versions for e in episodes], I32)
    return response


def episode_rows(response: rollout_pb2.GenerateEpisodesResponse) -> tuple[list, list, list, list]:
    """(token ids, log-probs, loss masks, weight versions) of every episode as read-only arrays, checked to line
    up: one row per episode, the same length in each column."""
    num = sum(len(g.episodes) for g in response.groups)
    columns = [unpack_rows(response.response_rows, I32, "response_rows"),
               unpack_rows(response.logprob_rows, F32, "logprob_rows"),
               unpack_rows(response.loss_mask_rows, I32, "loss_mask_rows"),
               unpack_rows(response.version_rows, I32, "version_rows")]
    names = ("response_rows", "logprob_rows", "loss_mask_rows", "version_rows")
    for name, rows in zip(names, columns):
        if len(rows) != num:
            raise ValueError(f"{name}: {len(rows)} rows for {num} episodes")
        if any(len(a) != len(b) for a, b in zip(rows, columns[0])):
            raise ValueError(f"{name}: row lengths differ from response_rows'")
    return tuple(columns)


def episodes_from_pb(response: rollout_pb2.GenerateEpisodesResponse) -> list[EpisodeGroup]:
    ids, logprobs, masks, versions = episode_rows(response)
    k, out = 0, []
    for g in response.groups:
        episodes = []
        for e in g.episodes:
            episodes.append(Episode(
                prompt_ids=e.prompt_ids[:] or g.prompt_ids[:], response_ids=as_list(ids[k]),
                logprobs=as_list(logprobs[k]), loss_mask=as_list(masks[k]), weight_versions=as_list(versions[k]),
                text=e.text, end_reason=e.end_reason, num_turns=e.num_turns, num_tool_calls=e.num_tool_calls,
                num_tool_errors=e.num_tool_errors, env_reward=e.env_reward if e.HasField("env_reward") else None,
                env_metrics=dict(e.env_metrics)))
            k += 1
        out.append(EpisodeGroup(prompt_id=g.prompt_id, episodes=episodes))
    return out
