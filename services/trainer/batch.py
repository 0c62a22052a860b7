"""Validation of the trainer's inputs (services/trainer/types.py), on rank 0 before any rank runs, and the batch's
cut into mini-batches."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from services.common.tensors.modeling import validate_sequences
from services.trainer.updates.losses import AGG_MODES, DPO_LOSSES, KL_ALIASES, KL_PENALTIES
from services.trainer.policy_losses import policy_loss_settings
from services.trainer.types import ActorLoss, CriticLoss, CriticSample, DPOLoss, PreferencePair, TrainSample


def _check_aligned(i: int, name: str, values: Sequence[float], n: int, *, where: str = "samples") -> None:
    if len(values) != n:
        raise ValueError(f"{where}[{i}].{name}: {len(values)} values for {n} response tokens")
    if isinstance(values, np.ndarray):  # a packed field
        if np.isfinite(values).all():
            return
    elif math.isfinite(sum(values)):    # one C loop: a nan or inf anywhere makes it non-finite (overflow: loop)
        return
    for t, v in enumerate(values):
        if not math.isfinite(v):
            raise ValueError(f"{where}[{i}].{name}[{t}]: not finite ({v})")


def _check_loss_mask(i: int, mask: Sequence[int] | None, n: int, *, where: str = "samples") -> None:
    """An empty (or None) mask is all ones; a set one has one 0/1 value per response token."""
    if mask is None or not len(mask):
        return
    if len(mask) != n:
        raise ValueError(f"{where}[{i}].loss_mask: {len(mask)} values for {n} response tokens")
    values = np.asarray(mask)
    bad = (values != 0) & (values != 1)
    if bad.any():
        t = int(np.argmax(bad))
        raise ValueError(f"{where}[{i}].loss_mask[{t}]: must be 0 or 1, got {values[t]}")


def loss_mask_of(sample, n: int | None = None) -> np.ndarray:
    """A sample's loss mask as float32 [n] (its `loss_mask`, or all ones when it has none)."""
    n = len(sample.response_ids) if n is None else n
    mask = getattr(sample, "loss_mask", None)
    if mask is None or not len(mask):
        return np.ones(n, dtype=np.float32)
    return np.asarray(mask, dtype=np.float32)


def has_loss_mask(sample) -> bool:
    mask = getattr(sample, "loss_mask", None)
    return mask is not None and len(mask) > 0


def num_model_tokens(sample) -> int:
    """Response tokens the model sampled (the loss counts these; observation tokens are not)."""
    mask = getattr(sample, "loss_mask", None)
    return len(sample.response_ids) if mask is None or not len(mask) else int(np.count_nonzero(mask))


MAX_PPO_EPOCHS = 64


def _check_schedule(ppo_epochs: int, mini_batch_size: int, num_samples: int, dp_size: int, where: str) -> None:
    if ppo_epochs < 1:
        raise ValueError(f"{where}.ppo_epochs: must be >= 1, got {ppo_epochs}")
    if ppo_epochs > MAX_PPO_EPOCHS:
        # One request must not hold the trainer for ever.
        raise ValueError(f"{where}.ppo_epochs: at most {MAX_PPO_EPOCHS}, got {ppo_epochs}")
    if mini_batch_size < 0:
        raise ValueError(f"{where}.mini_batch_size: must be >= 0, got {mini_batch_size}")
    # Every DP rank needs at least one sample of every mini-batch, the last (shorter) one included.
    sizes = [len(m) for m in mini_batches(num_samples, mini_batch_size)]
    if min(sizes) < dp_size:
        raise ValueError(f"{where}.mini_batch_size: a mini-batch of {min(sizes)} samples cannot be split over "
                         f"dp_size={dp_size} ranks ({num_samples} samples, mini_batch_size={mini_batch_size})")


def is_on_policy(samples: Sequence[TrainSample]) -> bool:
    """True when no sample carries old log-probs: the update uses its own, detached."""
    return not any(len(s.old_logprobs) for s in samples)


def validate_actor_batch(samples: Sequence[TrainSample], loss: ActorLoss, *, vocab_size: int,
                         max_len: int | None, dp_size: int = 1) -> None:
    """Raises ValueError naming the field (and sample index) of the first bad input."""
    if len(samples) == 0:
        raise ValueError("samples: empty batch")
    validate_sequences([s.prompt_ids for s in samples], [s.response_ids for s in samples], vocab_size=vocab_size,
                       max_len=max_len, field="samples")
    if KL_ALIASES.get(loss.kl_type, loss.kl_type) not in KL_PENALTIES:
        raise ValueError(f"loss.kl_type: unknown {loss.kl_type!r} (expected one of {', '.join(KL_PENALTIES)})")
    if loss.loss_agg_mode not in AGG_MODES:
        raise ValueError(f"loss.loss_agg_mode: unknown {loss.loss_agg_mode!r} (expected one of {', '.join(AGG_MODES)})")
    policy_loss_settings(loss.policy_loss, loss.policy_loss_settings, key="loss.policy_loss")
    if AGG_MODES[loss.loss_agg_mode].scaled and not (math.isfinite(loss.loss_scale_factor)
                                                     and loss.loss_scale_factor > 0):
        raise ValueError(f"loss.loss_scale_factor: {loss.loss_agg_mode} divides by a constant length > 0, "
                         f"got {loss.loss_scale_factor}")
    if not (math.isfinite(loss.kl_coef) and loss.kl_coef >= 0):
        raise ValueError(f"loss.kl_coef: must be >= 0, got {loss.kl_coef}")
    if not math.isfinite(loss.entropy_coef):
        raise ValueError(f"loss.entropy_coef: not finite ({loss.entropy_coef})")
    if not (math.isfinite(loss.temperature) and loss.temperature > 0):
        raise ValueError(f"loss.temperature: must be > 0, got {loss.temperature}")
    _check_schedule(loss.ppo_epochs, loss.mini_batch_size, len(samples), dp_size, "loss")
    on_policy = is_on_policy(samples)
    if on_policy and (loss.ppo_epochs != 1 or len(list(mini_batches(len(samples), loss.mini_batch_size))) != 1):
        raise ValueError(f"samples[*].old_logprobs: empty, which is allowed only for one optimizer step per batch "
                         f"(ppo_epochs=1 and one mini-batch), got ppo_epochs={loss.ppo_epochs}, "
                         f"mini_batch_size={loss.mini_batch_size} for {len(samples)} samples")
    for i, s in enumerate(samples):
        n = len(s.response_ids)
        _check_aligned(i, "advantages", s.advantages, n)
        if not on_policy:
            _check_aligned(i, "old_logprobs", s.old_logprobs, n)
        if loss.kl_coef > 0:
            _check_aligned(i, "ref_logprobs", s.ref_logprobs, n)
        _check_loss_mask(i, s.loss_mask, n)


def validate_critic_batch(samples: Sequence[CriticSample], loss: CriticLoss, *, vocab_size: int,
                          max_len: int | None, dp_size: int = 1) -> None:
    if len(samples) == 0:
        raise ValueError("samples: empty batch")
    validate_sequences([s.prompt_ids for s in samples], [s.response_ids for s in samples], vocab_size=vocab_size,
                       max_len=max_len, field="samples")
    if not (math.isfinite(loss.clip_value) and loss.clip_value >= 0):
        raise ValueError(f"clip_value: must be >= 0, got {loss.clip_value}")
    _check_schedule(loss.ppo_epochs, loss.mini_batch_size, len(samples), dp_size, "request")
    for i, s in enumerate(samples):
        n = len(s.response_ids)
        _check_aligned(i, "returns", s.returns, n)
        if loss.clip_value > 0:
            _check_aligned(i, "old_values", s.old_values, n)
        _check_loss_mask(i, s.loss_mask, n)


def validate_dpo_batch(pairs: Sequence[PreferencePair], loss: DPOLoss, *, vocab_size: int, max_len: int | None,
                       dp_size: int = 1) -> None:
    """Raises ValueError naming the field (and pair index) of the first bad input."""
    if len(pairs) == 0:
        raise ValueError("pairs: empty batch")
    if loss.loss_type not in DPO_LOSSES:
        raise ValueError(f"loss.loss_type: unknown {loss.loss_type!r} (expected one of {', '.join(DPO_LOSSES)})")
    if not (math.isfinite(loss.beta) and loss.beta > 0):
        raise ValueError(f"loss.beta: must be > 0, got {loss.beta}")
    if not 0 <= loss.label_smoothing < 0.5:
        raise ValueError(f"loss.label_smoothing: must be in [0, 0.5), got {loss.label_smoothing}")
    if loss.label_smoothing and loss.loss_type != "cdpo":
        raise ValueError(f"loss.label_smoothing: only loss_type cdpo uses it (got {loss.label_smoothing} with "
                         f"loss_type {loss.loss_type!r})")
    _check_schedule(1, loss.mini_batch_size, len(pairs), dp_size, "loss")
    for i, p in enumerate(pairs):
        for name in ("prompt_ids", "chosen_ids", "rejected_ids"):
            ids = getattr(p, name)
            if len(ids) == 0:
                raise ValueError(f"pairs[{i}].{name}: empty")
            bad = [t for t in ids if t < 0 or t >= vocab_size]
            if bad:
                raise ValueError(f"pairs[{i}].{name}: token id {bad[0]} outside the vocabulary [0, {vocab_size})")
        for name in ("chosen_ids", "rejected_ids"):
            n = len(p.prompt_ids) + len(getattr(p, name))
            if max_len is not None and n > max_len:
                raise ValueError(f"pairs[{i}].{name}: prompt + response are {n} tokens, over the model's limit "
                                 f"of {max_len}")
        for name in ("ref_chosen_logprob", "ref_rejected_logprob"):
            v = getattr(p, name)
            if not math.isfinite(v):
                raise ValueError(f"pairs[{i}].{name}: not finite ({v})")


def mini_batches(num_samples: int, mini_batch_size: int) -> list[list[int]]:
    """Consecutive index ranges of the (already shuffled) batch; 0 = one mini-batch of everything."""
    size = mini_batch_size or num_samples
    return [list(range(start, min(start + size, num_samples))) for start in range(0, num_samples, size)]
