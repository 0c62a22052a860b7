"""Preference-optimisation losses (DPO, IPO, conservative DPO): pure functions of summed log-probs [B]."""

from __future__ import annotations

import torch
import torch.nn.functional as F

DPO_LOSS_TYPES = ("sigmoid", "ipo", "cdpo")


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, *, beta: float, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair loss [B] and the implicit rewards, from summed response log-probs [B].

    sigmoid: -log sigma(beta * h)                                    (Rafailov et al. 2023)
    cdpo:    -(1 - eps) log sigma(beta * h) - eps log sigma(-beta * h)   (labels flipped with prob eps)
    ipo:     (h - 1 / (2 beta))^2                                    (Azar et al. 2023)
    with h = (pi_chosen - ref_chosen) - (pi_rejected - ref_rejected).
    """
    if beta <= 0:
        raise ValueError(f"beta: must be > 0, got {beta}")
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing: must be in [0, 0.5), got {label_smoothing}")
    chosen_logratio = policy_chosen - ref_chosen                      # [B]
    rejected_logratio = policy_rejected - ref_rejected                # [B]
    h = chosen_logratio - rejected_logratio
    if loss_type in ("sigmoid", "cdpo"):
        eps = label_smoothing if loss_type == "cdpo" else 0.0
        loss = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        loss = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        raise ValueError(f"loss_type: unknown {loss_type!r} (expected one of {', '.join(DPO_LOSS_TYPES)})")
    chosen_reward = beta * chosen_logratio.detach()
    rejected_reward = beta * rejected_logratio.detach()
    return loss, {"rewards/chosen": chosen_reward, "rewards/rejected": rejected_reward,
                  "rewards/margins": chosen_reward - rejected_reward,
                  "rewards/accuracy": (chosen_reward > rejected_reward).float(),
                  "logps/chosen": policy_chosen.detach(), "logps/rejected": policy_rejected.detach()}
