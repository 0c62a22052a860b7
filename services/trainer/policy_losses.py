"""The policy losses a TrainActor call may name, and each one's settings: the torch-free face of
services/trainer/updates/policy_losses.py (the math).

A loss is one function there and one line in POLICY_LOSSES here (its settings class beside it). A recipe names it
as `algorithm.policy_loss: {name: gspo, clip_ratio_low: 3.0e-4, ...}`; the coordinator checks the settings with
`policy_loss_settings` before a run starts and sends them to the trainer as a name and a JSON object it does not
read; the trainer checks them again with the same function. A setting has one name from the recipe to the loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from services.common.config import did_you_mean


class PolicyLossSettings(BaseModel):
    """A loss's own settings: unknown keys are refused, values are checked by their fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ClipSettings(PolicyLossSettings):
    """The importance ratio r is kept in [1 - clip_ratio_low, 1 + clip_ratio_high] (verl's names)."""

    clip_ratio_low: float = Field(0.2, ge=0, lt=1)
    clip_ratio_high: float = Field(0.2, ge=0)


class VanillaSettings(ClipSettings):
    """PPO's clipped surrogate (Schulman et al. 2017) with dual clip (Ye et al. 2020)."""

    # Dual-clip constant c > 1 bounding the loss of negative-advantage tokens at -c * A; 0 turns it off.
    clip_ratio_c: float = Field(3.0, ge=0)

    @model_validator(mode="after")
    def _dual_clip(self):
        if self.clip_ratio_c and self.clip_ratio_c <= 1:
            raise ValueError(f"clip_ratio_c: must be > 1 (or 0 to turn dual clip off), got {self.clip_ratio_c}")
        return self


class GSPOSettings(ClipSettings):
    """GSPO (Zheng et al. 2025) clips the sequence-level ratio, which stays near 1: its paper's range is tiny."""

    clip_ratio_low: float = Field(3e-4, ge=0, lt=1)
    clip_ratio_high: float = Field(4e-4, ge=0)


class CISPOSettings(ClipSettings):
    """CISPO (MiniMax-M1, 2025) clips the stop-gradient importance weight; its paper sets no lower bound in
    effect (clip_ratio_low 1.0: weights down to 0) and tunes the upper one."""

    clip_ratio_low: float = Field(1.0, ge=0, le=1)


class ImportanceSamplingSettings(PolicyLossSettings):
    """REINFORCE with an unclipped importance weight (Tinker's importance_sampling): no settings."""


@dataclass(frozen=True)
class PolicyLoss:
    """A registered loss: its function (`module:name`, torch, loaded by the trainer only) and its settings."""

    fn: str
    settings: type[PolicyLossSettings]


_MATH = "services.trainer.updates.policy_losses"
POLICY_LOSSES: dict[str, PolicyLoss] = {
    "vanilla": PolicyLoss(f"{_MATH}:vanilla", VanillaSettings),
    "gspo": PolicyLoss(f"{_MATH}:gspo", GSPOSettings),
    "gspo_token": PolicyLoss(f"{_MATH}:gspo_token", GSPOSettings),
    "cispo": PolicyLoss(f"{_MATH}:cispo", CISPOSettings),
    "importance_sampling": PolicyLoss(f"{_MATH}:importance_sampling", ImportanceSamplingSettings),
}
DEFAULT_POLICY_LOSS = "vanilla"


def policy_loss_settings(name: str, settings: Mapping[str, Any], *, key: str) -> PolicyLossSettings:
    """The typed settings of loss `name` from a plain map; a ValueError names `key`.name or `key`.<setting>."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"{key}.name: unknown policy loss {name!r}{did_you_mean(name, list(POLICY_LOSSES))} "
                         f"(expected one of {', '.join(POLICY_LOSSES)})")
    cls = POLICY_LOSSES[name].settings
    try:
        return cls(**dict(settings))
    except ValidationError as e:
        parts = []
        for err in e.errors():
            where = ".".join(str(p) for p in err["loc"])
            if err["type"] == "extra_forbidden":
                parts.append(f"{key}.{where}: not a setting of policy loss {name!r} "
                             f"(its settings: {', '.join(cls.model_fields) or 'none'})")
            elif err["type"] == "value_error":
                parts.append(f"{key}.{err['ctx']['error']}")
            else:
                parts.append(f"{key}.{where}: {err['msg']}")
        raise ValueError("; ".join(parts)) from None
