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


# ---- the training API's primitives (ForwardBackward, OptimStep: docs/training_api.md) -------------------------

@dataclass
class Datum:
    """One sequence of a ForwardBackward call (Tinker's Datum): position i of model_input predicts target_tokens[i];
    the per-position lists are aligned with target_tokens (empty when the loss does not read them)."""

    model_input: list[int]
    target_tokens: list[int]
    # cross_entropy: 0 on positions that carry no loss; empty = all 1.
    weights: list[float] = field(default_factory=list)
    # Policy losses: the sampler's log-prob of each target token, and each position's advantage.
    logprobs: list[float] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)


# Tinker's loss names -> the trainer's policy loss (services/trainer/policy_losses.py POLICY_LOSSES); "" is the
# cross-entropy of target_tokens. A loss of that registry may also be named directly, with its own settings.
PRIMITIVE_LOSSES: dict[str, str] = {"cross_entropy": "", "importance_sampling": "importance_sampling",
                                    "ppo": "vanilla", "cispo": "cispo"}


@dataclass
class PrimitiveLoss:
    """The loss of one ForwardBackward call. Every loss is summed over positions and Datums (Tinker's reduction):
    the caller scales advantages or weights for the normalisation it wants."""

    loss_fn: str = "cross_entropy"
    # Tinker's settings (ppo: clip_low_threshold, clip_high_threshold) or a registry loss's own settings.
    loss_fn_config: dict[str, float] = field(default_factory=dict)

    def policy_loss(self) -> tuple[str, dict[str, float]]:
        """(the registry's loss name or "" for cross-entropy, its settings); a ValueError names loss_fn."""
        name = PRIMITIVE_LOSSES.get(self.loss_fn, self.loss_fn)
        config = dict(self.loss_fn_config)
        if name == "":
            if config:
                raise ValueError(f"loss_fn_config: cross_entropy takes no settings, got {sorted(config)}")
            return "", {}
        if self.loss_fn == "ppo":
            # Tinker's ppo clips the ratio to [clip_low_threshold, clip_high_threshold] (0.8, 1.2), no dual clip.
            low, high = config.pop("clip_low_threshold", 0.8), config.pop("clip_high_threshold", 1.2)
            if config:
                raise ValueError(f"loss_fn_config: ppo takes clip_low_threshold and clip_high_threshold, got "
                                 f"{sorted(config)}")
            # Checked here, by the client's own keys (the registry's would name clip_ratio_low / clip_ratio_high).
            if not 0 < low <= 1:
                raise ValueError(f"loss_fn_config.clip_low_threshold: must be in (0, 1], got {low}")
            if high < 1:
                raise ValueError(f"loss_fn_config.clip_high_threshold: must be at least 1, got {high}")
            return name, {"clip_ratio_low": 1.0 - low, "clip_ratio_high": high - 1.0, "clip_ratio_c": 0.0}
        return name, config


@dataclass
class AdamParams:
    """One OptimStep's AdamW hyperparameters (Tinker's AdamParams and its defaults)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    # 0 turns clipping off.
    grad_clip_norm: float = 0.0

