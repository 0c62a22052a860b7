"""What the trainer is asked to train on: samples, preference pairs and the loss settings of each update.

Plain dataclasses, no tensors: the servicer and the coordinator build them, services/trainer/convert.py
moves them over the wire, services/trainer/batch.py validates them before any rank runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainSample:
    """One scored sample of a policy update; per-token lists are aligned with response_ids."""

    prompt_ids: list[int]
    response_ids: list[int]
    advantages: list[float]
    # Empty in every sample of a batch that is one optimizer step (one epoch, one mini-batch): the update's
    # own detached log-probs stand in (the ratio is exactly 1), which saves a forward pass over the batch.
    old_logprobs: list[float]
    # Required when kl_coef > 0.
    ref_logprobs: list[float] = field(default_factory=list)
    # Per response token: 1 = sampled by the model, 0 = an observation (tool or environment output of a multi-turn
    # episode) that no loss term or metric counts. Empty = every response token is the model's.
    loss_mask: list[int] = field(default_factory=list)


@dataclass
class ActorLoss:
    """Loss settings of one TrainActor call (the ActorLoss message, with proto zeros read as defaults)."""

    # A key of services.trainer.policy_losses.POLICY_LOSSES, and that loss's own settings (its settings class
    # there: clip_ratio_low, clip_ratio_high, ...); a setting left out takes the class's default.
    policy_loss: str = "vanilla"
    policy_loss_settings: dict[str, Any] = field(default_factory=dict)
    kl_coef: float = 0.0
    # A key of services.trainer.updates.losses.KL_PENALTIES (or one of verl's aliases).
    kl_type: str = "k3"
    entropy_coef: float = 0.0
    # A key of services.trainer.updates.losses.AGG_MODES.
    loss_agg_mode: str = "token-mean"
    # The constant length a scaled loss_agg_mode (seq-mean-token-sum-norm) divides each sequence's sum by; 0 = unset.
    loss_scale_factor: float = 0.0
    ppo_epochs: int = 1
    # Samples per optimizer step; 0 = the whole batch.
    mini_batch_size: int = 0
    temperature: float = 1.0


@dataclass
class CriticSample:
    """One sample of a critic update: return targets and pre-update values per response token."""

    prompt_ids: list[int]
    response_ids: list[int]
    returns: list[float]
    old_values: list[float] = field(default_factory=list)
    # Per response token: 1 = the model's (its value is fitted), 0 = an observation token. Empty = all ones.
    loss_mask: list[int] = field(default_factory=list)


@dataclass
class CriticLoss:
    """Settings of one TrainCritic call."""

    # Value clip range; 0 turns clipping off (old_values are then optional).
    clip_value: float = 0.0
    ppo_epochs: int = 1
    mini_batch_size: int = 0


@dataclass
class PreferencePair:
    """One preference pair of a DPO update: a prompt, a preferred and a dispreferred response, and the
    reference policy's summed log-probs of both responses (given the prompt)."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    ref_chosen_logprob: float
    ref_rejected_logprob: float


@dataclass
class DPOLoss:
    """Settings of one TrainDPO call (the DPOLoss message, with proto zeros read as defaults)."""

    # A key of services.trainer.updates.losses.DPO_LOSSES.
    loss_type: str = "sigmoid"
    beta: float = 0.1
    # cdpo only: probability that a preference label is flipped.
    label_smoothing: float = 0.0
    # Pairs per optimizer step; 0 = the whole batch.
    mini_batch_size: int = 0


@dataclass
class RunStart:
    """Where a starting run's weights come from (ConfigureRun): the trainer's model path, or a checkpoint."""

    # A checkpoint folder (SaveCheckpoint's); empty: the model path the trainer started from.
    checkpoint: str = ""


@dataclass(frozen=True)
class RunStep:
    """A run's step as the trainer records it with the update that made it (the RunStep message)."""

    run_id: str
    # 1 = the run's first update.
    step: int
    # The run's data position once this step's prompts (or pairs) are used.
    data_position: int = 0
    # What the coordinator measured of the step before the update (rewards, timings): kept with the trainer's
    # record so a step the coordinator never committed is recorded with them. Not part of the step's identity.
    metrics: dict[str, float] = field(default_factory=dict, compare=False, hash=False)
