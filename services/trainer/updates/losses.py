"""Policy, value, KL, entropy and preference losses: pure per-token (or per-pair) math on tensors.

Everything here imports only torch. Losses come out per token; `aggregate` reduces them with a
response mask. Gradient accumulation stays exact because `aggregate` takes the normaliser (token
or sequence count of the whole mini-batch, across micro-batches and DP ranks) from the caller.
KL estimators, aggregation modes and preference losses are registries: a new one is a function and
one entry in its dict (request validation reads the same dicts).
"""

from __future__ import annotations

from typing import Callable, Literal, NamedTuple

import torch
import torch.nn.functional as F


def clipped_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, *, clip_ratio_low: float,
                        clip_ratio_high: float, clip_ratio_c: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token [B, T] and where clipping was active (float 0/1, [B, T]).

    `clip_ratio_c` = c > 1 bounds the loss of negative-advantage tokens at -c * adv (dual clip, Ye et al.
    2020); 0 turns it off. The policy losses (updates/policy_losses.py) build on it.
    """
    ratio = (logp - old_logp).exp()                                           # [B, T]
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = torch.maximum(unclipped, clipped)
    is_clipped = (clipped > unclipped).float()
    if clip_ratio_c > 0:
        bounded = torch.minimum(loss, -adv * clip_ratio_c)
        is_clipped = torch.where((adv < 0) & (bounded < loss), torch.ones_like(is_clipped), is_clipped)
        loss = torch.where(adv < 0, bounded, loss)
    return loss, is_clipped


# Schulman's estimators of KL(pi || pi_ref) from sampled tokens, each a function of log(pi / pi_ref) [B, T].

def kl_k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio


def kl_k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio.square()


def kl_k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """r - log r - 1 with r = pi_ref / pi: non-negative and low-variance. As in verl, log r is clamped to
    [-20, 20] before the exp and the estimate to [-10, 10] so one outlier token cannot blow up a step."""
    neg = (-log_ratio).clamp(-20.0, 20.0)                                     # log(pi_ref / pi)
    return (neg.exp() - neg - 1.0).clamp(-10.0, 10.0)


KL_PENALTIES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}
# verl spellings of the same estimators.
KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) [B, T] by the estimator `kind` (KL_PENALTIES or an alias)."""
    fn = KL_PENALTIES.get(KL_ALIASES.get(kind, kind))
    if fn is None:
        raise ValueError(f"kl_type: unknown {kind!r} (expected one of {', '.join(KL_PENALTIES)})")
    return fn(logp - ref_logp)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the last dim: [B, T, V] -> [B, T] (the entropy bonus per token)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def logprobs_from_logits(logits: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
                         temperature: float):
    """modeling.response_logprobs' math on a forward's logits [B, L, V]: (logp, entropy) [B, R] of the targets
    [B, R] at the response positions [B, R] (the logit that predicts each), masked."""
    logits = torch.gather(logits, 1, positions.unsqueeze(-1).expand(-1, -1, logits.size(-1))).float()   # [B, R, V]
    if temperature and temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = torch.gather(logp_all, 2, targets.unsqueeze(-1)).squeeze(-1) * mask
    entropy = -(logp_all.exp() * logp_all).sum(-1) * mask
    return logp, entropy


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


class Aggregation(NamedTuple):
    """A loss_agg_mode: the summed loss of a batch from the per-token loss and mask [B, T], and what its mean
    divides by (response tokens, or sequences with a response token); `scaled` modes divide the sum once more
    by a constant length (ActorLoss.loss_scale_factor), the same for every sequence and micro-batch."""

    total: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    unit: Literal["token", "sequence"]
    scaled: bool = False


AGG_MODES: dict[str, Aggregation] = {
    # Sum over all tokens / number of tokens.
    "token-mean": Aggregation(lambda loss, mask: (loss * mask).sum(), "token"),
    # Mean over sequences of the per-sequence sum.
    "seq-mean-token-sum": Aggregation(lambda loss, mask: (loss * mask).sum(-1).sum(), "sequence"),
    # Mean over sequences of the per-sequence mean.
    "seq-mean-token-mean": Aggregation(
        lambda loss, mask: ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum(), "sequence"),
    # Dr. GRPO (Liu et al. 2025): each sequence's sum over a constant length, then the mean over sequences; no
    # sequence's tokens weigh more for being short.
    "seq-mean-token-sum-norm": Aggregation(lambda loss, mask: (loss * mask).sum(-1).sum(), "sequence", scaled=True),
}


def _aggregation(mode: str) -> Aggregation:
    if mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode: unknown {mode!r} (expected one of {', '.join(AGG_MODES)})")
    return AGG_MODES[mode]


def num_units(mask: torch.Tensor, mode: str) -> int:
    """What `mode` averages over: response tokens or sequences with a response token."""
    if _aggregation(mode).unit == "token":
        return int(mask.sum().item())
    return int((mask.sum(-1) > 0).sum().item())


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str, *, denom: float | None = None,
              scale: float = 0.0) -> torch.Tensor:
    """Reduces a per-token loss [B, T] to a scalar by the aggregation `mode` (AGG_MODES).

    `denom` replaces the count of this batch (tokens or sequences, see `num_units`) with the count of
    the whole mini-batch, so summing the results of its micro-batches gives the mini-batch's loss. `scale` is
    the constant length of a scaled mode (required there, unused elsewhere).
    """
    agg = _aggregation(mode)
    total = agg.total(loss, mask.to(loss.dtype))
    if denom is None:
        denom = num_units(mask, mode)
    if agg.scaled:
        if scale <= 0:
            raise ValueError(f"loss_scale_factor: {mode} divides by a constant length > 0, got {scale}")
        total = total / scale
    return total / max(float(denom), 1.0)


# Preference losses of the margin h = (pi_chosen - ref_chosen) - (pi_rejected - ref_rejected) [B].

def conservative_dpo(h: torch.Tensor, *, beta: float, label_smoothing: float) -> torch.Tensor:
    """cdpo: -(1 - eps) log sigma(beta * h) - eps log sigma(-beta * h), labels flipped with prob eps."""
    eps = label_smoothing
    return -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)


def sigmoid_dpo(h: torch.Tensor, *, beta: float, label_smoothing: float) -> torch.Tensor:
    """sigmoid: -log sigma(beta * h) (Rafailov et al. 2023), cdpo without label noise."""
    return conservative_dpo(h, beta=beta, label_smoothing=0.0)


def ipo(h: torch.Tensor, *, beta: float, label_smoothing: float) -> torch.Tensor:
    """ipo: (h - 1 / (2 beta))^2 (Azar et al. 2023)."""
    return (h - 1.0 / (2.0 * beta)) ** 2


DPO_LOSSES: dict[str, Callable[..., torch.Tensor]] = {"sigmoid": sigmoid_dpo, "ipo": ipo, "cdpo": conservative_dpo}


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, *, beta: float, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair loss [B] of `loss_type` (DPO_LOSSES) and the implicit rewards, from summed response log-probs [B]."""
    if beta <= 0:
        raise ValueError(f"beta: must be > 0, got {beta}")
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing: must be in [0, 0.5), got {label_smoothing}")
    if loss_type not in DPO_LOSSES:
        raise ValueError(f"loss_type: unknown {loss_type!r} (expected one of {', '.join(DPO_LOSSES)})")
    chosen_logratio = policy_chosen - ref_chosen                      # [B]
    rejected_logratio = policy_rejected - ref_rejected                # [B]
    loss = DPO_LOSSES[loss_type](chosen_logratio - rejected_logratio, beta=beta, label_smoothing=label_smoothing)
    chosen_reward = beta * chosen_logratio.detach()
    rejected_reward = beta * rejected_logratio.detach()
    return loss, {"rewards/chosen": chosen_reward, "rewards/rejected": rejected_reward,
                  "rewards/margins": chosen_reward - rejected_reward,
                  "rewards/accuracy": (chosen_reward > rejected_reward).float(),
                  "logps/chosen": policy_chosen.detach(), "logps/rejected": policy_rejected.detach()}
