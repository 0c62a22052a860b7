"""Typed calls to the services: the coordinator's protobuf edge (messages in, dataclasses out)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from meshrl.v1 import (common_pb2, reference_pb2_grpc, reward_pb2, reward_pb2_grpc, rollout_pb2, rollout_pb2_grpc,
                       trainer_pb2, trainer_pb2_grpc)
from coordinator.recipe.data import Problem
from services.common.convert import SequenceBatch, logprobs_from_pb, sequences_to_pb
from services.common.tensors.packed import I32, pack_i32
from services.reward.config import ComponentConfig
from services.reward.convert import components_to_pb, extra_info_to_json, results_from_pb
from services.reward.types import Scored
from services.rollout.config import AgentConfig
from services.rollout.convert import episode_rows, episodes_request_to_pb, sample_rows, sampling_to_pb, token_versions
from services.rollout.types import EpisodePrompt, SamplingParams
from services.trainer.convert import (actor_loss_to_pb, run_step_to_pb, train_columns_to_pb, train_critic_to_pb,
                                      train_dpo_to_pb)
from services.trainer.types import ActorLoss, CriticLoss, CriticSample, DPOLoss, PreferencePair, RunStep


@dataclass
class Sample:
    """One generated response and everything the step computes for it.

    Token ids are int32 and per-token values float32 numpy arrays (read-only views of the replies they came
    in, so a batch moves between services as a few array copies); lists work too where a sample is made by
    hand."""

    problem: Problem
    group: int                  # index of its prompt in the batch
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    rollout_logprobs: np.ndarray
    text: str
    finish_reason: str
    weight_version: int
    reward: float = 0.0
    components: dict[str, float] = field(default_factory=dict)
    # Extra numeric keys the reward function returned (a verl dict's keys beside `score`).
    reward_extras: dict[str, float] = field(default_factory=dict)
    # Why the sample could not be scored ("" = scored): it is kept, recorded as failed, and trains on nothing.
    reward_error: str = ""
    # algorithm.overlong_buffer's penalty (<= 0), already added to `reward` by the coordinator.
    overlong_penalty: float = 0.0
    # Filled by the step.
    old_logprobs: list[float] = field(default_factory=list)
    ref_logprobs: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    returns: list[float] = field(default_factory=list)
    # The rollout replica (host:port) that generated it: per-replica metrics show who served each step.
    replica: str = ""
    # Per response token: 1 = sampled by the model (trained on), 0 = an observation (a tool's or environment's
    # output appended in a multi-turn episode). None = every response token is the model's.
    loss_mask: np.ndarray | None = None
    # Multi-turn episodes: end_reason, num_turns, num_tool_calls, num_tool_errors ({} for a single turn).
    episode: dict = field(default_factory=dict)
    # Per response token, the weight version that produced it, when a weight update landed while it decoded
    # (partial rollouts); None = every token is weight_version's (weight_version is always the oldest).
    weight_versions: np.ndarray | None = None
    # Prompt tokens the replica did not prefill for it (prefix cache or its group's shared prefill).
    cached_prompt_tokens: int = 0

    @property
    def id(self) -> str:
        return f"{self.problem.id}#{self.group}"


def rollout_stub(channel):
    return rollout_pb2_grpc.RolloutStub(channel)


def reward_stub(channel):
    return reward_pb2_grpc.RewardStub(channel)


def reference_stub(channel):
    return reference_pb2_grpc.ReferenceStub(channel)


def trainer_stub(channel):
    return trainer_pb2_grpc.TrainerStub(channel)


async def generate(stub, problems: Sequence[Problem], groups: Sequence[int], sampling: SamplingParams, *,
                   partial_rollout: str = "off") -> list[Sample]:
    request = rollout_pb2.GenerateRequest(
        # A chat prompt goes as the token ids its template rendered (once); a plain one as text.
        prompts=[rollout_pb2.Prompt(id=f"{p.id}@{g}", prompt_ids=p.prompt_ids) if p.prompt_ids else
                 rollout_pb2.Prompt(id=f"{p.id}@{g}", text=p.prompt) for p, g in zip(problems, groups)],
        sampling=sampling_to_pb(sampling), columnar=True, partial_rollout=partial_rollout)
    response = await stub.Generate(request)
    if len(response.responses) != len(problems):
        raise RuntimeError(f"rollout returned {len(response.responses)} responses for {len(problems)} prompts")
    for problem, rr in zip(problems, response.responses):
        if len(rr.samples) != sampling.n:
            raise RuntimeError(f"rollout returned {len(rr.samples)} samples for prompt {problem.id}, expected "
                               f"{sampling.n}")
    ids, logprobs = sample_rows(response)     # columns, or per-sample fields from a replica that ignores columnar
    samples = []
    for problem, group, rr in zip(problems, groups, response.responses):
        prompt_ids = np.asarray(rr.prompt_ids[:], dtype=I32)
        for s in rr.samples:
            k = len(samples)
            versions = token_versions(s, len(ids[k]), f"prompt {problem.id}")
            samples.append(Sample(problem, group, prompt_ids, ids[k], logprobs[k], s.text, s.finish_reason,
                                  s.weight_version,
                                  weight_versions=None if versions is None else np.asarray(versions, dtype=np.int64),
                                  cached_prompt_tokens=s.cached_prompt_tokens))
    return samples


async def generate_episodes(stub, problems: Sequence[Problem], groups: Sequence[int], sampling: SamplingParams,
                            agent: AgentConfig, *, partial_rollout: str = "off") -> list[Sample]:
    """n multi-turn episodes per problem, played in the rollout replica (GenerateEpisodes): each one a Sample whose
    loss_mask marks the model's tokens and whose `episode` holds end_reason and the turn and tool counts."""
    prompts = [EpisodePrompt(id=f"{p.id}@{g}", text="" if p.messages or p.prompt_ids else p.prompt,
                             prompt_ids=[] if p.messages else list(p.prompt_ids), messages=list(p.messages),
                             agent_name=p.agent_name, tools_kwargs=_tools_kwargs(p))
               for p, g in zip(problems, groups)]
    response = await stub.GenerateEpisodes(episodes_request_to_pb(prompts, sampling, agent, partial_rollout))
    if [len(g.episodes) for g in response.groups] != [sampling.n] * len(problems):
        raise RuntimeError(f"rollout returned {[len(g.episodes) for g in response.groups]} episodes for "
                           f"{len(problems)} prompts, expected {sampling.n} each")
    ids, logprobs, masks, versions = episode_rows(response)
    samples = []
    for problem, group, g in zip(problems, groups, response.groups):
        for e in g.episodes:
            k = len(samples)
            # an env_agent episode's prompt holds its environment's first observation
            prompt_ids = np.asarray(e.prompt_ids[:] or g.prompt_ids[:], dtype=I32)
            model = masks[k] == 1
            oldest = int(versions[k][model].min()) if model.any() else -1
            # per-token versions only when a weight update landed mid-episode (observation tokens: the oldest)
            per_token = None if len(set(versions[k][model].tolist())) <= 1 else \
                np.where(model, versions[k], oldest).astype(np.int64)
            samples.append(Sample(
                problem, group, prompt_ids, ids[k], logprobs[k], e.text,
                "stop" if e.end_reason == "answer" else e.end_reason, oldest,
                loss_mask=np.asarray(masks[k], dtype=np.int8), weight_versions=per_token,
                episode={"end_reason": e.end_reason, "num_turns": e.num_turns, "num_tool_calls": e.num_tool_calls,
                         "num_tool_errors": e.num_tool_errors,
                         **({"env_reward": e.env_reward} if e.HasField("env_reward") else {})}))
    return samples


def _tools_kwargs(p: Problem) -> dict:
    """verl's `extra_info.tools_kwargs` of a row (what its tools and environment are created with)."""
    kwargs = p.extra_info.get("tools_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ValueError(f"problem {p.id}: extra_info.tools_kwargs must be a mapping, got {type(kwargs).__name__}")
    return kwargs


async def score(stub, samples: Sequence[Sample], components: Sequence[ComponentConfig] = ()) -> list[Scored]:
    """Scores of the samples (with their extra keys, and the error of each one that failed); `components` (a
    run's rule components) replace the replica's own list."""
    request = reward_pb2.ScoreRequest(items=[
        reward_pb2.ScoreItem(id=s.id, prompt=s.problem.prompt, response=s.text,
                             response_ids_packed=pack_i32(s.response_ids), ground_truth=s.problem.ground_truth,
                             data_source=s.problem.data_source, extra_info_json=extra_info_to_json(s.problem.extra_info))
        for s in samples], components=components_to_pb(components))
    response = await stub.Score(request)
    if len(response.results) != len(samples):
        raise RuntimeError(f"reward returned {len(response.results)} results for {len(samples)} samples")
    return results_from_pb(response)


def logprobs_request(samples: Sequence[Sample], temperature: float = 1.0, *, packed: bool = False,
                     columnar: bool = False) -> common_pb2.LogProbsRequest:
    return sequences_to_pb(SequenceBatch(ids=[str(i) for i in range(len(samples))],
                                         prompts=[s.prompt_ids for s in samples],
                                         responses=[s.response_ids for s in samples], temperature=temperature),
                           packed=packed, columnar=columnar)


async def logprobs(stub, samples: Sequence[Sample], temperature: float = 1.0, *, adapter: str = ""):
    """Each sample's log-probs as a float32 array (read-only, over the reply's bytes); asked in columns. adapter: a
    rollout replica's LoRA adapter to score under ("" = its model as held)."""
    request = logprobs_request(samples, temperature, columnar=True)
    request.adapter = adapter
    response = await stub.ComputeLogProbs(request)
    out = logprobs_from_pb(response, as_arrays=True)
    if len(out) != len(samples) or any(len(lp) != len(s.response_ids) for lp, s in zip(out, samples)):
        raise RuntimeError(f"ComputeLogProbs answered {len(out)} rows of log-probs that do not match the "
                           f"{len(samples)} sequences asked for")
    return out


async def values(stub, samples: Sequence[Sample]) -> list[list[float]]:
    request = trainer_pb2.ValuesRequest(sequences=logprobs_request(samples, packed=True).sequences)
    response = await stub.ComputeValues(request)
    return [r.values[:] for r in response.results]


async def train_actor(stub, samples: Sequence[Sample], loss: ActorLoss, run_step: RunStep | None = None
                      ) -> tuple[int, dict[str, float]]:
    """One update, recorded by the trainer as `run_step` (a repeat of its last one is not applied again)."""
    request = trainer_pb2.TrainActorRequest(loss=actor_loss_to_pb(loss), run_step=run_step_to_pb(run_step))
    train_columns_to_pb(samples, into=request.columns)
    response = await stub.TrainActor(request)
    return response.step, dict(response.metrics)


async def train_critic(stub, samples: Sequence[Sample], loss: CriticLoss, run_step: RunStep | None = None
                       ) -> dict[str, float]:
    request = train_critic_to_pb([CriticSample(prompt_ids=s.prompt_ids, response_ids=s.response_ids,
                                               returns=s.returns, old_values=s.values,
                                               loss_mask=[] if s.loss_mask is None else s.loss_mask)
                                  for s in samples], loss, run_step)
    response = await stub.TrainCritic(request)
    return dict(response.metrics)


@dataclass
class PushOutcome:
    version: int
    num_bytes: int
    seconds: float
    failed: dict[str, str]
    # target -> the adapter name it serves the run's weights under ("" = merged/full weights)
    adapters: dict[str, str] = field(default_factory=dict)


async def push_weights(stub, targets: Sequence[str]) -> PushOutcome:
    response = await stub.PushWeights(trainer_pb2.PushWeightsRequest(targets=list(targets)))
    return PushOutcome(response.weight_version, response.num_bytes, response.seconds,
                       {r.target: r.error for r in response.results if not r.ok},
                       {r.target: r.adapter for r in response.results if r.ok})


async def unload_adapter(stub, name: str) -> bool:
    """A rollout replica's adapter `name` off its slots; False when it did not hold it."""
    return (await stub.UnloadAdapter(rollout_pb2.UnloadAdapterRequest(name=name), timeout=30.0)).unloaded


async def info(stub) -> common_pb2.ServiceInfo:
    return await stub.GetInfo(common_pb2.GetInfoRequest())


async def save_checkpoint(stub, path: str) -> trainer_pb2.CheckpointResponse:
    return await stub.SaveCheckpoint(trainer_pb2.CheckpointRequest(path=path))


async def load_checkpoint(stub, path: str, run_step: RunStep | None = None) -> trainer_pb2.CheckpointResponse:
    """Restores `path`; `run_step` is the run step whose weights it holds (the trainer's new record)."""
    return await stub.LoadCheckpoint(trainer_pb2.CheckpointRequest(path=path, run_step=run_step_to_pb(run_step)))


async def train_dpo(stub, pairs, loss: DPOLoss, run_step: RunStep | None = None) -> tuple[int, dict[str, float]]:
    """pairs: objects with prompt_ids, chosen_ids, rejected_ids and the filled ref_chosen, ref_rejected."""
    request = train_dpo_to_pb([PreferencePair(prompt_ids=p.prompt_ids, chosen_ids=p.chosen_ids,
                                              rejected_ids=p.rejected_ids, ref_chosen_logprob=p.ref_chosen,
                                              ref_rejected_logprob=p.ref_rejected) for p in pairs], loss)
    if run_step is not None:
        request.run_step.CopyFrom(run_step_to_pb(run_step))
    response = await stub.TrainDPO(request)
    return response.step, dict(response.metrics)


async def sequence_logprob_sums(stub, prompts, responses) -> list[float]:
    """Summed response log-probs of (prompt_ids, response_ids) pairs under a trainer or reference."""
    request = common_pb2.LogProbsRequest(
        sequences=[common_pb2.TokenSequence(id=str(i), prompt_ids=p, response_ids=r)
                   for i, (p, r) in enumerate(zip(prompts, responses))], temperature=1.0)
    response = await stub.ComputeLogProbs(request)
    return [sum(r.logprobs) for r in response.results]
