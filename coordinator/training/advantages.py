"""Advantage estimators as pure functions of rewards (and values): GRPO, RLOO, REINFORCE++, GAE, on-policy
distillation's reverse KL to a teacher, and
ADVANTAGE_ESTIMATORS, the registry `algorithm.adv_estimator` names (a new estimator is one function and one
entry).

Group estimators take each sample's group id ([B], any values): samples may come in any order and a group
may be short, so nothing depends on the batch being laid out as [num_groups, group_size].

Masks are per token [B, T], 1 on the tokens the model sampled. They may have holes: a multi-turn episode's
observation tokens (tool or environment output) sit between the model's turns with mask 0. Every estimator
works on the masked tokens as if the others were not there (as verl and SkyRL do): advantages and returns are 0
on them, whitening counts only masked tokens, and the token-level recursions (reward-to-go, GAE) step over a
hole without discounting across it, so gamma and lambda apply per model token and the value after a turn's last
token is the value of the next turn's first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


def group_index(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Group ids [B] -> (each sample's group numbered 0..G-1 [B], each group's size [G])."""
    _, index, sizes = torch.unique(groups, return_inverse=True, return_counts=True)
    return index, sizes


def group_sum(x: torch.Tensor, index: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Per-sample values [B] summed per group -> [G]."""
    return torch.zeros(num_groups, dtype=x.dtype).index_add_(0, index, x)


def grpo_advantages(rewards: torch.Tensor, groups: torch.Tensor, *, norm_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """Group-normalised advantages. rewards, groups: [B] -> [B].

    With norm_by_std=False this is Dr. GRPO's mean-centred advantage (no std scaling).
    """
    index, sizes = group_index(groups)
    centred = rewards - (group_sum(rewards, index, len(sizes)) / sizes)[index]
    if not norm_by_std:
        return centred
    # Unbiased, as torch.std in the reference implementations; a group of one has std 0 (and advantage 0).
    var = group_sum(centred ** 2, index, len(sizes)) / (sizes - 1).clamp(min=1)
    return centred / (var.sqrt()[index] + eps)


def zero_variance_fraction(rewards: torch.Tensor, groups: torch.Tensor, *, tol: float = 1e-6) -> float:
    """The fraction of prompt groups whose rewards are all equal (within tol): the group estimators (GRPO, RLOO,
    REINFORCE++ with baseline) give every sample of such a group advantage 0, so it teaches nothing. rewards,
    groups: [B]. When every group is one sample (rollout.n 1, only the batch estimators allow it) the batch is
    the group: their baseline is the batch."""
    index, sizes = group_index(groups)
    if bool((sizes < 2).all()):
        index, sizes = torch.zeros_like(index), sizes.sum().reshape(1)
    rewards = rewards.double()
    lo = torch.full((len(sizes),), torch.inf, dtype=rewards.dtype).scatter_reduce(0, index, rewards, "amin")
    hi = torch.full((len(sizes),), -torch.inf, dtype=rewards.dtype).scatter_reduce(0, index, rewards, "amax")
    return float(((hi - lo) <= tol).double().mean())


def rloo_advantages(rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Leave-one-out baseline: r_i - mean_{j != i} r_j over i's group. rewards, groups: [B] -> [B]."""
    index, sizes = group_index(groups)
    if bool((sizes < 2).any()):
        raise ValueError("rloo needs at least 2 samples per prompt (rollout.n >= 2)")
    baseline = (group_sum(rewards, index, len(sizes))[index] - rewards) / (sizes[index] - 1)
    return rewards - baseline


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reward-to-go per masked token. token_rewards, mask: [B, T] -> [B, T] (0 off the mask). Unmasked tokens
    pass the running return through untouched (their rewards do not count, and no discount is applied)."""
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros(token_rewards.size(0), dtype=token_rewards.dtype)
    m = mask.to(token_rewards.dtype)
    for t in reversed(range(token_rewards.size(1))):
        running = torch.where(m[:, t] > 0, token_rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns * m


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


def reinforce_pp_baseline_advantages(rewards: torch.Tensor, groups: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """REINFORCE++ with a group baseline: subtract the group mean, then whiten over the batch.

    rewards, groups: [B]; mask: [B, T] -> [B, T].
    """
    index, sizes = group_index(groups)
    centred = (rewards - (group_sum(rewards, index, len(sizes)) / sizes)[index]).unsqueeze(1)
    return masked_whiten(centred.expand_as(mask.to(centred.dtype)).clone(), mask)


def gae_advantages(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float,
                   lam: float, whiten: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the masked (model) tokens. All [B, T]; returns (advantages, returns),
    0 off the mask.

    The value after the last masked token is 0 (the episode ends there). An unmasked token (an observation inside
    an episode) is skipped: the next value of the token before it is the value of the first masked token after
    it, and its own value, reward and TD error do not count.
    """
    B, T = token_rewards.shape
    adv = torch.zeros_like(token_rewards)
    last = torch.zeros(B, dtype=token_rewards.dtype)
    next_value = torch.zeros(B, dtype=token_rewards.dtype)
    m = mask.to(token_rewards.dtype)
    for t in reversed(range(T)):
        on = m[:, t] > 0
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        last = torch.where(on, delta + gamma * lam * last, last)
        next_value = torch.where(on, values[:, t].to(next_value.dtype), next_value)
        adv[:, t] = last
    adv = adv * m
    returns = (adv + values) * m
    if whiten:
        adv = masked_whiten(adv, mask)
    return adv * m, returns


@dataclass(frozen=True)
class AdvantageBatch:
    """One step's samples as the estimators see them; [B, T] over response tokens unless noted."""

    token_rewards: torch.Tensor         # the sequence reward on its last token, less any per-token KL penalty
    mask: torch.Tensor
    groups: torch.Tensor                # [B] each sample's prompt group
    values: torch.Tensor | None = None  # the critic's values (GAE)

    @property
    def scores(self) -> torch.Tensor:
        """[B] each sample's whole (KL-penalised) reward."""
        return self.token_rewards.sum(1)


# An estimator: (batch, the `algorithm:` settings) -> (advantages [B, T], returns [B, T] or None).
EstimatorFn = Callable[[AdvantageBatch, Any], "tuple[torch.Tensor, torch.Tensor | None]"]


@dataclass(frozen=True)
class Estimator:
    fn: EstimatorFn
    # GAE: the critic's values before the advantages, critic training on the returns after.
    needs_critic: bool = False
    # Its baseline is the other samples of the same prompt: one sample per prompt (rollout.n 1) has none.
    needs_groups: bool = False


def _grpo(b: AdvantageBatch, a) -> tuple[torch.Tensor, None]:
    return grpo_advantages(b.scores, b.groups, norm_by_std=a.norm_adv_by_std).unsqueeze(1) * b.mask, None


def _rloo(b: AdvantageBatch, a) -> tuple[torch.Tensor, None]:
    return rloo_advantages(b.scores, b.groups).unsqueeze(1) * b.mask, None


def _reinforce_pp(b: AdvantageBatch, a) -> tuple[torch.Tensor, None]:
    return reinforce_pp_advantages(b.token_rewards, b.mask, gamma=a.gamma), None


def _reinforce_pp_baseline(b: AdvantageBatch, a) -> tuple[torch.Tensor, None]:
    return reinforce_pp_baseline_advantages(b.scores, b.groups, b.mask), None


def _distill(b: AdvantageBatch, a) -> tuple[torch.Tensor, None]:
    """Pure distillation: the reward has no part in the advantage (it is still scored and reported); the whole
    advantage is the reverse-KL term, which compute_advantages adds whenever distillation is on (distill_advantages)."""
    return torch.zeros_like(b.token_rewards), None


def distill_advantages(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, coef: float) -> torch.Tensor:
    """On-policy distillation's per-token advantage -coef * (log pi_student(y_t) - log pi_teacher(y_t)) [B, T], 0
    off the mask: the one-sample estimate of the reverse KL(student || teacher) at each sampled token, negated
    (Agarwal et al. 2024, GKD with lambda 1; Thinking Machines' on-policy distillation). Each token is its own
    reward, undiscounted and not whitened. student: the log-probs the tokens were sampled with (the rollout
    engine's); teacher: the teacher's log-probs of the same tokens."""
    return -coef * (student - teacher) * mask


def _gae(b: AdvantageBatch, a) -> tuple[torch.Tensor, torch.Tensor]:
    return gae_advantages(b.token_rewards, b.values, b.mask, gamma=a.gamma, lam=a.lam, whiten=a.whiten_advantages)


# Keys are exactly AlgorithmConfig.adv_estimator's values (a unit test holds them equal).
ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator(_grpo, needs_groups=True),
    "rloo": Estimator(_rloo, needs_groups=True),
    "reinforce_plus_plus": Estimator(_reinforce_pp),
    "reinforce_plus_plus_baseline": Estimator(_reinforce_pp_baseline, needs_groups=True),
    "gae": Estimator(_gae, needs_critic=True),
    "distill": Estimator(_distill),
}


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
