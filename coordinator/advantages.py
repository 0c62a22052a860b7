"""Advantage estimators as pure functions of rewards (and values): GRPO, RLOO, REINFORCE++, GAE."""

from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, *, norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-normalised advantages. rewards: [num_groups, group_size] -> same shape.

    With norm_by_std=False this is Dr. GRPO's mean-centred advantage (no std scaling).
    """
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not norm_by_std:
        return centred
    # unbiased=False would differ from the reference implementations that use torch.std (unbiased).
    std = rewards.std(dim=1, keepdim=True) if rewards.size(1) > 1 else torch.zeros_like(rewards[:, :1])
    return centred / (std + eps)


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Leave-one-out baseline: r_i - mean_{j != i} r_j. rewards: [num_groups, group_size >= 2]."""
    k = rewards.size(1)
    if k < 2:
        raise ValueError("rloo needs at least 2 samples per prompt (rollout.n >= 2)")
    baseline = (rewards.sum(dim=1, keepdim=True) - rewards) / (k - 1)
    return rewards - baseline


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reward-to-go per token. token_rewards, mask: [B, T] -> [B, T] (0 on padding)."""
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros(token_rewards.size(0), dtype=token_rewards.dtype)
    for t in reversed(range(token_rewards.size(1))):
        running = token_rewards[:, t] + gamma * running * mask[:, t]
        returns[:, t] = running
    return returns * mask


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the unmasked entries of the whole batch."""
    m = mask.to(x.dtype)
    n = m.sum().clamp(min=1)
    mean = (x * m).sum() / n
    var = (((x - mean) * m) ** 2).sum() / n
    return (x - mean) * torch.rsqrt(var + eps) * m


def reinforce_pp_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0) -> torch.Tensor:
    """REINFORCE++: discounted reward-to-go, whitened over the global batch. [B, T] -> [B, T]."""
    return masked_whiten(discounted_returns(token_rewards, mask, gamma), mask)


def reinforce_pp_baseline_advantages(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """REINFORCE++ with a group baseline: subtract the group mean, then whiten over the batch.

    rewards: [num_groups, group_size]; mask: [num_groups * group_size, T] -> [B, T].
    """
    centred = (rewards - rewards.mean(dim=1, keepdim=True)).reshape(-1, 1)
    return masked_whiten(centred.expand_as(mask.to(centred.dtype)).clone(), mask)


def gae_advantages(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float,
                   lam: float, whiten: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens. All [B, T]; returns (advantages, returns).

    The value after the last response token is 0 (the episode ends there).
    """
    B, T = token_rewards.shape
    adv = torch.zeros_like(token_rewards)
    last = torch.zeros(B, dtype=token_rewards.dtype)
    m = mask.to(token_rewards.dtype)
    for t in reversed(range(T)):
        next_value = values[:, t + 1] * m[:, t + 1] if t + 1 < T else torch.zeros(B, dtype=values.dtype)
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        last = (delta + gamma * lam * last * (m[:, t + 1] if t + 1 < T else 0)) * m[:, t]
        adv[:, t] = last
    returns = (adv + values) * m
    if whiten:
        adv = masked_whiten(adv, mask)
    return adv * m, returns


def kl_reward_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, coef: float) -> torch.Tensor:
    """Per-token reward shaping -coef * (logp - ref_logp) (the k1 estimator). [B, T]."""
    return -coef * (logp - ref_logp)


class AdaptiveKLController:
    """Proportional controller that moves the KL coefficient toward a target KL (Ziegler et al.)."""

    def __init__(self, init_coef: float, target: float, horizon: int):
        self.value = init_coef
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, num_samples: int) -> float:
        error = max(min(current_kl / self.target - 1, 0.2), -0.2)
        self.value *= 1 + error * num_samples / self.horizon
        return self.value
