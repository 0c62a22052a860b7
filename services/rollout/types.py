"""Requests, results and the engine interface of the rollout service (what convert.py maps the protobuf to).

SamplingParams checks itself when it is made, so sampling settings are validated once, where a request
enters (protobuf, HTTP JSON or a client's config), and an engine never holds an invalid one.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterable, Mapping

from services.common.errors import FailedPrecondition

if TYPE_CHECKING:   # a client that imports this face loads no torch
    import torch

    from services.common.weights import Manifest

MAX_SAMPLES_PER_PROMPT = 1024


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


@dataclass
class GenerateBatch:
    prompts: list[PromptInput]
    sampling: SamplingParams


@dataclass
class SampleResult:
    """One generated sample; logprobs are under the raw model distribution (no temperature/top_p)."""

    response_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str           # "stop" (eos or a stop string) or "length"
    weight_version: int
    # Per step, the top_logprobs most likely (token id, raw log-prob) pairs; None unless asked for.
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class PromptResult:
    prompt_id: str
    prompt_ids: list[int]
    samples: list[SampleResult]


class RolloutEngine(abc.ABC):
    """What every rollout engine offers the servicer (and the HTTP API)."""

    model_path: str
    weight_version: int = 0
    tokenizer = None

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

    async def refresh(self) -> None:
        """Brings what info() reports up to date (an upstream's capabilities); GetInfo awaits it first."""
        return None

    async def close(self) -> None:
        return None
