"""Rollout correction: importance weights between the trainer's old policy and the rollout engine's own log-probs,
and their metrics. Pure math on tensors; imports only torch.

The rollout engine samples from pi_rollout (another kernel stack, another precision, maybe older weights), the
trainer's PPO ratio is taken against pi_old. The weight w = pi_old / pi_rollout of each sampled token corrects
the gap: per token, per sequence (the product over its tokens) or as the sequence's geometric mean (exp of the
mean log-ratio). `truncate` caps w at the threshold (truncated importance sampling); `mask` keeps w = 1 where it
lies within [threshold_low, threshold] and rejects (w = 0) the token or sequence elsewhere; `mask_is` rejects the
same way and weights each kept token by its own token ratio (IcePop at level token, seq-mask-tis at level
geometric). A veto threshold rejects a whole sequence with any token ratio below it. The weights carry
no gradient, so a weight w >= 0 multiplied into a token's advantage scales that token's clipped PPO loss (dual
clip included) by exactly w.
"""

from __future__ import annotations

import torch

LEVELS = ("token", "sequence", "geometric")
METHODS = ("truncate", "mask", "mask_is")
# log-ratios are clamped before exp: a sequence's sum over hundreds of tokens must not overflow.
LOG_RATIO_BOUND = 20.0


def log_ratio_at_level(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """log(pi_old / pi_rollout) [B, T] at the weight's level, broadcast over each row's tokens [B, T]."""
    if level == "token":
        return log_ratio * mask
    total = (log_ratio * mask).sum(-1, keepdim=True)                           # [B, 1]
    if level == "geometric":
        total = total / mask.sum(-1, keepdim=True).clamp(min=1.0)
    elif level != "sequence":
        raise ValueError(f"algorithm.rollout_correction.level: unknown {level!r} (expected one of {LEVELS})")
    return total.expand_as(log_ratio) * mask


def correction_weights(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, *, level: str, method: str,
                       threshold: float, threshold_low: float | None = None,
                       veto_threshold: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, raw) [B, T]: the applied weights (0 off the mask) and the untruncated ones at the level. old /
    rollout: the trainer's and the rollout engine's log-probs of the sampled tokens [B, T]; mask: 1 on response
    tokens."""
    mask = mask.float()
    lr = log_ratio_at_level(old - rollout, mask, level).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    raw = lr.exp() * mask
    if method == "truncate":
        weights = raw.clamp(max=threshold) * mask
    elif method in ("mask", "mask_is"):
        low = 1.0 / threshold if threshold_low is None else threshold_low
        keep = ((raw <= threshold) & (raw >= low)).float()
        if method == "mask_is":
            keep = keep * ((old - rollout) * mask).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
        weights = keep * mask
    else:
        raise ValueError(f"algorithm.rollout_correction.method: unknown {method!r} (expected one of {METHODS})")
    if veto_threshold is not None:
        weights = weights * (1.0 - vetoed(old, rollout, mask, veto_threshold)).unsqueeze(-1)
    return weights, raw


def vetoed(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, veto_threshold: float) -> torch.Tensor:
    """[B] 1.0 for each sequence with a response token whose ratio pi_old / pi_rollout is below veto_threshold
    (compared as log-ratios, before any bound: a token 10^6 times less likely under the trainer is caught)."""
    low = (old - rollout) < torch.log(torch.tensor(veto_threshold, dtype=old.dtype))
    return (low & (mask > 0)).any(-1).float()


def _row_values(x: torch.Tensor, mask: torch.Tensor, level: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The values a level's statistics run over: every masked token, or one per sequence (its first masked
    token's, equal to all its masked tokens'; an episode's observation tokens are 0) for the sequence levels."""
    if level == "token":
        keep = mask > 0
        return x[keep], keep
    rows = mask.sum(-1) > 0
    first = (mask > 0).float().argmax(-1, keepdim=True)                        # [B, 1]
    return x.gather(-1, first).squeeze(-1)[rows], rows


def correction_metrics(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor,
                       raw: torch.Tensor, *, level: str, method: str, threshold: float,
                       veto_threshold: float | None = None) -> dict[str, float]:
    """`rollout_corr/` metrics: the weights' mean and max, their effective sample size (ESS / N in (0, 1]), the
    share truncated or masked, KL(rollout || trainer) by the k1 and k3 estimators, and the log-perplexity
    difference (trainer minus rollout, mean over sequences)."""
    mask = mask.float()
    ntok = mask.sum().clamp(min=1.0)
    # mask_is weights vary over a kept sequence's tokens: their statistics run over tokens.
    w, _ = _row_values(weights, mask, "token" if method == "mask_is" else level)
    r, _ = _row_values(raw, mask, level)
    n = max(w.numel(), 1)
    ess = float(w.sum().square() / (n * w.square().sum())) if float(w.square().sum()) > 0 else 0.0
    lr = (old - rollout) * mask                                                # log(pi_old / pi_rollout)
    k3 = ((lr.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp() - 1.0 - lr) * mask).sum() / ntok
    lengths = mask.sum(-1).clamp(min=1.0)
    rows = mask.sum(-1) > 0
    log_ppl_diff = ((-lr.sum(-1) / lengths)[rows]).mean() if bool(rows.any()) else torch.zeros(())
    out = {"rollout_corr/weight_mean": float(w.mean()) if w.numel() else 0.0,
           "rollout_corr/weight_max": float(w.max()) if w.numel() else 0.0,
           "rollout_corr/raw_weight_max": float(r.max()) if r.numel() else 0.0,
           "rollout_corr/ess": ess,
           "rollout_corr/kl_k1": float(-lr.sum() / ntok),
           "rollout_corr/kl_k3": float(k3),
           "rollout_corr/log_ppl_diff": float(log_ppl_diff)}
    if method == "truncate":
        out["rollout_corr/fraction_truncated"] = float((r > threshold).float().sum() / n)
    else:
        # Zero at the level: a rejected sequence's tokens are all 0, a kept one's first token is not.
        rejected, _ = _row_values(weights, mask, level)
        out["rollout_corr/fraction_masked"] = float((rejected == 0).float().mean()) if rejected.numel() else 0.0
    if veto_threshold is not None:
        rows = mask.sum(-1) > 0
        out["rollout_corr/fraction_vetoed"] = float(vetoed(old, rollout, mask, veto_threshold)[rows].mean()) \
            if bool(rows.any()) else 0.0
    return out
