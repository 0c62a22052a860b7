"""Requests, results and the engine interface of the rollout service (what convert.py maps the protobuf to).

SamplingParams checks itself when it is made, so sampling settings are validated once, where a request
enters (protobuf, HTTP JSON or a client's config), and an engine never holds an invalid one.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterable, Mapping

from services.common.errors import FailedPrecondition

if TYPE_CHECKING:   # a client that imports this face loads no torch
    import torch

    from services.common.manifest import Manifest

MAX_SAMPLES_PER_PROMPT = 1024


# The CUDA-graph decoder's static KV cache is sized in buckets (services/rollout/engine_torch/cuda_decode.py); the
# memory estimate of a recipe (coordinator/recipe/memory.py) sizes it by the same rule.
def bucket_batch(n: int, cap: int) -> int:
    """Rows of the cache bucket for `n` rows: powers of two from 8, at most `cap` (and at least `n`)."""
    b = 8
    while b < n:
        b *= 2
    return max(n, min(b, cap))


def bucket_len(n: int, step: int = 256) -> int:
    """Token slots of the cache bucket for `n` tokens a row: the next multiple of `step`."""
    return -(-n // step) * step

PARTIAL_ROLLOUTS = ("off", "continue", "pause")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one batch; already resolved against the replica's defaults, checked when made."""

    n: int = 1
    temperature: float = 1.0     # 0 = greedy
    top_p: float = 1.0           # nucleus mass in (0, 1]
    max_tokens: int = 16         # new tokens per sample
    stop: list[str] = field(default_factory=list)
    seed: int | None = None      # None = unseeded
    top_logprobs: int = 0        # also return the k most likely tokens per step (HTTP API only)
    adapter: str = ""            # LoRA adapter to sample with (RolloutEngine.load_adapter's name); "" = base model

    def __post_init__(self):
        validate_sampling(self)


def validate_sampling(p: SamplingParams) -> None:
    """Bad sampling settings are ValueErrors naming the field."""
    if p.n < 1:
        raise ValueError(f"sampling.n: must be >= 1, got {p.n}")
    if p.n > MAX_SAMPLES_PER_PROMPT:
        # Bounded so one request cannot build decode rows until memory runs out.
        raise ValueError(f"sampling.n: at most {MAX_SAMPLES_PER_PROMPT}, got {p.n}")
    if not p.temperature >= 0:  # also catches NaN
        raise ValueError(f"sampling.temperature: must be >= 0, got {p.temperature}")
    if not 0 < p.top_p <= 1:
        raise ValueError(f"sampling.top_p: must be in (0, 1], got {p.top_p}")
    if p.max_tokens < 1:
        raise ValueError(f"sampling.max_tokens: must be >= 1, got {p.max_tokens}")
    if any(s == "" for s in p.stop):
        raise ValueError("sampling.stop: stop strings must not be empty")
    if not 0 <= p.top_logprobs <= 20:
        raise ValueError(f"sampling.top_logprobs: must be in [0, 20], got {p.top_logprobs}")
    if not isinstance(p.adapter, str):
        raise ValueError(f"sampling.adapter: must be a string (\"\" = the base model), got {p.adapter!r}")


def check_weight_version(version: int) -> None:
    """A weight update's version is a ValueError naming manifest.version unless it is >= 0."""
    if version < 0:
        raise ValueError(f"manifest.version: must be >= 0, got {version}")


@dataclass
class PromptInput:
    """One prompt: token ids take precedence over text (which needs a tokenizer)."""

    id: str = ""
    text: str = ""
    prompt_ids: list[int] = field(default_factory=list)
    # Text is tokenized with the tokenizer's special tokens (its bos), as vLLM does for completions;
    # a rendered chat template already holds them, so the HTTP chat route turns this off.
    add_special_tokens: bool = True
    # The multi-turn episode (or proxy session) this prompt is a turn of: an engine that keeps KV between turns
    # (the torch engine's paged cache) keeps the episode's until end_episode. "" = none; ignored when n > 1.
    episode_id: str = ""


@dataclass
class GenerateBatch:
    prompts: list[PromptInput]
    sampling: SamplingParams
    # Partial rollouts (PARTIAL_ROLLOUTS): a weight update may land between decode steps of this batch (each token
    # tagged with its version) instead of waiting for the batch to end: "continue" over the old KV cache, "pause"
    # with the running rows' KV cache recomputed by the new weights; "off" waits.
    partial_rollout: str = "off"

    def __post_init__(self):
        if self.partial_rollout not in PARTIAL_ROLLOUTS:
            raise ValueError(f"partial_rollout: must be one of {', '.join(PARTIAL_ROLLOUTS)}, got "
                             f"{self.partial_rollout!r}")


@dataclass
class SampleResult:
    """One generated sample; logprobs are under the raw model distribution (no temperature/top_p)."""

    response_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str           # "stop" (eos or a stop string) or "length"
    weight_version: int          # the OLDEST weight version among its tokens
    # Per step, the top_logprobs most likely (token id, raw log-prob) pairs; None unless asked for.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # Per response token, the weight version whose forward produced it, when a weight update landed while the
    # sample was decoding (partial rollouts: GenerateBatch.partial_rollout); None = every token is weight_version's.
    weight_versions: list[int] | None = None
    # Prompt tokens not prefilled for it: prefix-cache hits or its group's shared prefill (kv_cache paged).
    cached_prompt_tokens: int = 0


@dataclass
class PromptResult:
    prompt_id: str
    prompt_ids: list[int]
    samples: list[SampleResult]


# ---- episodes (multi-turn, tool calls): the loop lives in services/rollout/agents/episodes.py

END_REASONS = ("answer", "max_turns", "length", "tool_error", "env_lost")


@dataclass
class Episode:
    """One finished episode, token-exact: the ids the model sampled and the observation ids between its turns."""

    prompt_ids: list[int]         # the first prompt as rendered (chat template, generation prompt)
    response_ids: list[int]       # every token after the prompt, in order: sampled and observation tokens
    logprobs: list[float]         # per response token; 0.0 on observation tokens
    loss_mask: list[int]          # per response token: 1 sampled by the model, 0 observation (tool/env)
    weight_versions: list[int]    # per response token: the weight version that sampled it (-1 observation)
    text: str                     # the decoded response (special tokens skipped), for the reward
    end_reason: str               # answer | max_turns | length | tool_error | env_lost
    num_turns: int = 0
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    # Sum of the environment's step rewards (env_agent), None when no environment rewarded.
    env_reward: float | None = None
    # Numeric keys the environment reported (last value per key).
    env_metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class EpisodeGroup:
    """The n episodes of one prompt, in order (GenerateEpisodes' answer per prompt)."""

    prompt_id: str
    episodes: list[Episode]


@dataclass
class EpisodePrompt(PromptInput):
    """A prompt of an episode: chat messages (rendered by the replica, tools included) or text/ids as for Generate,
    and the data row's agent fields (verl's `agent_name`, `extra_info.tools_kwargs`)."""

    messages: list[dict] = field(default_factory=list)
    agent_name: str = ""
    tools_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AgentLimits:
    """Per-episode limits (the `rollout.agent` section)."""

    max_turns: int = 4
    max_total_tokens: int = 2048         # response tokens of an episode, sampled + observation
    max_tokens_per_turn: int = 512
    # What a failed tool call does: "observe" (the model reads the error and goes on) or "end" (end_reason tool_error)
    tool_error_policy: str = "observe"


class RolloutEngine(abc.ABC):
    """What every rollout engine offers the servicer (and the HTTP API)."""

    model_path: str
    weight_version: int = 0
    tokenizer = None
    # Whether the engine serves LoRA adapters over its frozen base (load_adapter, SamplingParams.adapter); an engine
    # that does not receives merged full weights instead.
    supports_adapters: bool = False

    @abc.abstractmethod
    async def generate(self, batch: GenerateBatch) -> list[PromptResult]:
        """n samples for every prompt, one PromptResult per prompt in order."""

    @abc.abstractmethod
    async def logprobs(self, prompts: list[list[int]], responses: list[list[int]],
                       temperature: float = 1.0) -> tuple[list[list[float]], int]:
        """Per-token log-probs of each response and the weight version that computed them."""

    @abc.abstractmethod
    def info(self) -> dict:
        """Engine, limits, device and dtype for GetInfo."""

    @abc.abstractmethod
    async def update_weights(self, manifest: Manifest, buckets: AsyncIterable[tuple[bytes, int]]) -> dict:
        """Applies a whole update or nothing; returns {weight_version, num_bytes, seconds}."""

    async def apply_update(self, version: int, tensors: Mapping[str, torch.Tensor], *,
                           flat: torch.Tensor | None = None) -> None:
        """Swaps in tensors that arrived whole and checked out (device transports), or raises with the old
        weights kept. Engines that take weights only as a gRPC stream keep this default."""
        raise FailedPrecondition(f"UpdateWeights: the {self.info().get('engine', '?')} engine takes weights over "
                                 "transport grpc only")

    def load_adapter(self, name: str, version: int, config: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Replaces adapter `name` whole (or adds it) as `version`: `config` holds r, lora_alpha and target_modules;
        `tensors` are PEFT's saved names without the adapter name (`base_model.model.<module>.lora_A.weight`,
        `...lora_B.weight`). Raises with the old adapter kept when anything does not fit. Engines with
        supports_adapters = False keep this default."""
        raise FailedPrecondition(f"load_adapter: the {self.info().get('engine', '?')} engine does not serve LoRA "
                                 "adapters (it takes merged full weights)")

    async def apply_adapter(self, name: str, version: int, config: dict, tensors: dict[str, torch.Tensor]) -> None:
        """load_adapter where the engine lets a weight swap land (the torch engine: between decodes); this default
        runs it in a worker thread."""
        import asyncio

        await asyncio.to_thread(self.load_adapter, name, version, config, tensors)

    def loaded_adapters(self) -> dict[str, int]:
        """{adapter name: its weight version} of the adapters this replica serves now (none by default)."""
        return {}

    def unload_adapter(self, name: str) -> bool:
        """Frees adapter `name`'s slot; False when it was not loaded. Engines that serve no adapters keep this."""
        raise FailedPrecondition(f"unload_adapter: the {self.info().get('engine', '?')} engine serves no LoRA "
                                 "adapters")

    async def remove_adapter(self, name: str) -> bool:
        """unload_adapter where a weight swap lands (like apply_adapter); this default runs it in a thread."""
        import asyncio

        return await asyncio.to_thread(self.unload_adapter, name)

    def end_episode(self, episode_id: str) -> None:
        """The episode's turns are over: KV an engine kept for its next turn may go. This default keeps none."""
        return None

    async def refresh(self) -> None:
        """Brings what info() reports up to date (an upstream's capabilities); GetInfo awaits it first."""
        return None

    async def close(self) -> None:
        return None
