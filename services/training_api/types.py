"""What the training API's calls take and give, as plain dataclasses (Tinker's names): the engine, the servicer's
converters and the light client share them. The trainer's own (Datum, PrimitiveLoss, AdamParams) are reused."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ClientInfo:
    """An open training client."""

    client_id: str
    base_model: str
    # LoRA rank of its adapters (0: full fine-tuning).
    rank: int
    weight_version: int = 0
    step: int = 0
    # The trainer adapter it trains and samples under ("" = the trainer's weights: a full-parameter client).
    adapter: str = ""


@dataclass
class SampledSequence:
    """One sampled continuation: its tokens, their log-probs under the weights that sampled them, and why it
    stopped ("stop": eos or a stop string; "length": max_tokens)."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str


@dataclass
class SampleResponse:
    """The sequences of one prompt."""

    sequences: list[SampledSequence] = field(default_factory=list)


@dataclass
class StateInfo:
    """A saved or loaded state: its folder, the optimizer steps and weight version it holds."""

    path: str
    step: int = 0
    weight_version: int = 0
