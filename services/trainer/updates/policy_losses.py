"""Policy losses: per-token loss [B, T] and where its clip was active [B, T] from the update's log-probs, the
old (or rollout) log-probs, the advantages and the response mask, under the loss's own settings.

Each function here is registered by one line in services/trainer/policy_losses.py (POLICY_LOSSES, with its
settings class); actor.py reduces what it returns by the run's loss_agg_mode. Off the mask the caller has set
old = logp (detached) and adv = 0, so every token off the mask contributes nothing and no nan.
"""

from __future__ import annotations

import functools
import json
from typing import Callable, NamedTuple

import torch

from services.common.plugins import load_object
from services.trainer.policy_losses import (POLICY_LOSSES, CISPOSettings, GSPOSettings, ImportanceSamplingSettings,
                                            PolicyLossSettings, VanillaSettings, policy_loss_settings)
from services.trainer.updates.losses import clipped_policy_loss

# exp of a larger log-ratio overflows float32 long before the clip matters (verl clamps at the same place).
MAX_LOG_RATIO = 10.0


class PolicyLossOut(NamedTuple):
    loss: torch.Tensor                                                        # [B, T] per-token loss
    clipped: torch.Tensor                                                     # [B, T] 1.0 where the clip acted


def vanilla(logp, old_logp, adv, mask, s: VanillaSettings) -> PolicyLossOut:
    """PPO: max(-A r, -A clip(r)) per token, r = pi / pi_old, and dual clip for A < 0."""
    return PolicyLossOut(*clipped_policy_loss(logp, old_logp, adv, clip_ratio_low=s.clip_ratio_low,
                                              clip_ratio_high=s.clip_ratio_high, clip_ratio_c=s.clip_ratio_c))


def _seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked mean over each row: [B, T] -> [B]."""
    m = mask.to(x.dtype)
    return (x * m).sum(-1) / m.sum(-1).clamp(min=1.0)


def gspo(logp, old_logp, adv, mask, s: GSPOSettings) -> PolicyLossOut:
    """GSPO: the sequence ratio s_i = exp(mean_t(logp - old_logp)) clipped at sequence level against the
    sequence advantage A_i (the mean of its tokens' advantages), max(-A_i s_i, -A_i clip(s_i)) on every token
    of sequence i. Its gradient is s_i A_i / |y_i| * sum_t grad logp_t (the paper's), under seq-mean-token-mean
    the loss is the paper's mean over sequences."""
    log_s = _seq_mean(logp - old_logp, mask).clamp(max=MAX_LOG_RATIO)      # [B]
    ratio, a = log_s.exp(), _seq_mean(adv, mask)
    unclipped = -a * ratio
    clipped = -a * ratio.clamp(1.0 - s.clip_ratio_low, 1.0 + s.clip_ratio_high)
    loss, is_clipped = torch.maximum(unclipped, clipped), (clipped > unclipped).float()       # [B]
    return PolicyLossOut(loss.unsqueeze(-1).expand_as(logp), is_clipped.unsqueeze(-1).expand_as(logp))


def gspo_token(logp, old_logp, adv, mask, s: GSPOSettings) -> PolicyLossOut:
    """GSPO-token: s_i,t = sg[s_i] * exp(logp_t - sg[logp_t]) (value s_i, gradient s_i grad logp_t), clipped per
    token against its own advantage A_t; with equal advantages over a sequence it is GSPO."""
    log_s = _seq_mean(logp - old_logp, mask).detach().unsqueeze(-1)       # [B, 1]
    log_st = (logp - logp.detach() + log_s).clamp(max=MAX_LOG_RATIO)      # [B, T]
    return PolicyLossOut(*clipped_policy_loss(log_st, torch.zeros_like(log_st), adv,
                                              clip_ratio_low=s.clip_ratio_low, clip_ratio_high=s.clip_ratio_high))


def cispo(logp, old_logp, adv, mask, s: CISPOSettings) -> PolicyLossOut:
    """CISPO: -sg(clip(r_t, 1 - clip_ratio_low, 1 + clip_ratio_high)) * A_t * logp_t. The clip bounds the
    weight, never drops a token: every token keeps its REINFORCE gradient."""
    ratio = (logp - old_logp).detach().clamp(max=MAX_LOG_RATIO).exp()
    weight = ratio.clamp(1.0 - s.clip_ratio_low, 1.0 + s.clip_ratio_high)
    return PolicyLossOut(-weight * adv * logp, (weight != ratio).float())


def importance_sampling(logp, old_logp, adv, mask, s: ImportanceSamplingSettings) -> PolicyLossOut:
    """-exp(logp - old_logp) * A_t per token, unclipped: REINFORCE corrected for the sampler's log-probs (Tinker's
    importance_sampling; the ratio's value is 1 on policy, its gradient A_t grad logp_t)."""
    ratio = (logp - old_logp).clamp(max=MAX_LOG_RATIO).exp()
    return PolicyLossOut(-ratio * adv, torch.zeros_like(logp))


PolicyLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], PolicyLossOut]


@functools.lru_cache(maxsize=32)
def _bound(name: str, settings_json: str) -> PolicyLossFn:
    settings: PolicyLossSettings = policy_loss_settings(name, json.loads(settings_json), key="loss.policy_loss")
    fn = load_object(POLICY_LOSSES[name].fn, "loss.policy_loss")
    return functools.partial(fn, s=settings)


def bound_policy_loss(name: str, settings: dict) -> PolicyLossFn:
    """Loss `name` (POLICY_LOSSES) with its settings checked and bound: (logp, old_logp, adv, mask) -> out."""
    return _bound(name, json.dumps(settings, sort_keys=True))
