"""Policy, value, KL and entropy losses of PPO-style updates: pure per-token math on [B, T] tensors.

Everything here imports only torch. Losses come out per token; `aggregate` reduces them with a
response mask. Gradient accumulation stays exact because `aggregate` takes the normaliser (token
or sequence count of the whole mini-batch, across micro-batches and DP ranks) from the caller.
"""

from __future__ import annotations

import torch

KL_TYPES = ("k1", "k2", "k3")
# verl spellings of the same estimators.
KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def clipped_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, *, clip_low: float,
                        clip_high: float, dual_clip: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token [B, T] and where clipping was active (float 0/1, [B, T]).

    `dual_clip` = c > 1 bounds the loss of negative-advantage tokens at -c * adv (Ye et al. 2020);
    0 turns it off.
    """
    ratio = (logp - old_logp).exp()                                           # [B, T]
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    is_clipped = (clipped > unclipped).float()
    if dual_clip > 0:
        bounded = torch.minimum(loss, -adv * dual_clip)
        is_clipped = torch.where((adv < 0) & (bounded < loss), torch.ones_like(is_clipped), is_clipped)
        loss = torch.where(adv < 0, bounded, loss)
    return loss, is_clipped


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled tokens (Schulman's k1, k2, k3).

    k3 = r - log r - 1 with r = pi_ref / pi is non-negative and low-variance; as in verl, log r is
    clamped to [-20, 20] before the exp and the estimate to [-10, 10] so one outlier token cannot
    blow up a step.
    """
    kind = KL_ALIASES.get(kind, kind)
    log_ratio = logp - ref_logp                                               # [B, T]
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        neg = (-log_ratio).clamp(-20.0, 20.0)                                 # log(pi_ref / pi)
        return (neg.exp() - neg - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"kl_type: unknown {kind!r} (expected one of {', '.join(KL_TYPES)})")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the last dim: [B, T, V] -> [B, T] (the entropy bonus per token)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, *,
                       clip_value: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO value loss 0.5 * max((v - R)^2, (v_clip - R)^2) per token, and where clipping was active.

    v_clip keeps the new value within clip_value of the old one; clip_value = 0 turns clipping off.
    """
    unclipped = (values - returns).square()                                   # [B, T]
    if clip_value <= 0:
        return 0.5 * unclipped, torch.zeros_like(unclipped)
    v_clip = old_values + (values - old_values).clamp(-clip_value, clip_value)
    clipped = (v_clip - returns).square()
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def num_units(mask: torch.Tensor, mode: str) -> int:
    """What `mode` averages over: response tokens (token-mean) or sequences with a response token."""
    if mode == "token-mean":
        return int(mask.sum().item())
    if mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        return int((mask.sum(-1) > 0).sum().item())
    raise ValueError(f"loss_agg_mode: unknown {mode!r} (expected one of {', '.join(AGG_MODES)})")


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str, *, denom: float | None = None) -> torch.Tensor:
    """Reduces a per-token loss [B, T] to a scalar.

    token-mean: sum over all tokens / number of tokens; seq-mean-token-sum: mean over sequences of
    the per-sequence sum; seq-mean-token-mean: mean over sequences of the per-sequence mean.
    `denom` replaces the count of this batch (tokens or sequences, see `num_units`) with the count of
    the whole mini-batch, so summing the results of its micro-batches gives the mini-batch's loss.
    """
    mask = mask.to(loss.dtype)
    if mode == "token-mean":
        total = (loss * mask).sum()
    elif mode == "seq-mean-token-sum":
        total = (loss * mask).sum(-1).sum()
    elif mode == "seq-mean-token-mean":
        total = ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    else:
        raise ValueError(f"loss_agg_mode: unknown {mode!r} (expected one of {', '.join(AGG_MODES)})")
    if denom is None:
        denom = num_units(mask, mode)
    return total / max(float(denom), 1.0)
