"""Reward engine: scores a batch of responses with a weighted combination of reward components.

A component is a built-in rule (`services.reward.functions`), a user function (`package.module:function`,
run in a worker pool with a timeout), a sequence-classification reward model, or an embedding
similarity. Each is reported unweighted under its label; the score is the weighted sum. No gRPC here.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, Sequence

from pydantic import Field, field_validator, model_validator

from services.common.config import MeshSettings, PoolConfig, Section, ServerConfig
from services.reward.functions import REWARD_FUNCTIONS, SAMPLE_KWARGS

log = logging.getLogger("meshrl.reward")

# Component names that are not rule functions: reward models, resolved in services.reward.models.
MODEL_COMPONENTS = ("model", "embedding")


def check_rule_params(name: str, params: dict, where: str) -> None:
    """Rejects params a built-in does not declare (typos), then calls it once on an empty sample so a
    bad value (an invalid regex, a negative length) fails at start with its key named."""
    fn = REWARD_FUNCTIONS[name]
    declared = [p.name for p in inspect.signature(fn).parameters.values()
                if p.kind == p.KEYWORD_ONLY and p.name not in SAMPLE_KWARGS]
    for key in params:
        if key not in declared:
            raise ValueError(f"{where}.params.{key}: unknown param of {name} (it takes: {', '.join(declared) or 'none'})")
    try:
        fn(prompt="", response="", response_ids=[], ground_truth="", data_source="", **params)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where} ({name}): {e}") from None


class ComponentConfig(Section):
    """One reward component: `{name: exact_match, weight: 1.0, params: {...}}`.

    `name` is a built-in rule (exact_match, gsm8k, boxed, format, length_penalty), `model` (a
    sequence-classification reward model) or `embedding` (cosine similarity to the ground truth).
    With `function: "package.module:function"` it is a user function and `name` is only its label.
    """

    name: str
    weight: float = 1.0
    params: dict[str, Any] = Field(default_factory=dict)
    function: str | None = None
    # Key of this component in ScoreResult.components (default: name); needed to use one kind twice.
    label: str | None = None

    @field_validator("weight")
    @classmethod
    def _finite_weight(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError(f"must be a finite number, got {v}")
        return v

    @property
    def key(self) -> str:
        return self.label or self.name


class RewardConfig(PoolConfig):
    """`reward:` section."""

    components: list[ComponentConfig] = Field(default_factory=lambda: [ComponentConfig(name="exact_match")])
    # Shorthand for `components: [{name: <function name>, function: ...}]`.
    function: str | None = None
    # Seconds one call of a user function (one sample) may take before the call fails.
    timeout_s: float = Field(30.0, gt=0)
    # Worker processes that run user functions.
    num_workers: int = Field(2, ge=1)
    max_batch_size: int = Field(4096, ge=1)
    # torch CPU threads for reward models; unset, step times vary 20x on small machines.
    num_threads: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _check_components(self) -> "RewardConfig":
        if self.function is not None:
            if "components" in self.model_fields_set:
                raise ValueError("reward.function and reward.components are both set: put the user function "
                                 "in components as {name: ..., function: ...} to combine it with others")
            name = self.function.rpartition(":")[2] or self.function
            # Direct __dict__ write: validate_assignment would re-enter this validator.
            self.__dict__["components"] = [ComponentConfig(name=name, function=self.function)]
        if not self.components:
            raise ValueError("reward.components: empty; give at least one component")
        seen: dict[str, int] = {}
        for i, c in enumerate(self.components):
            where = f"reward.components[{i}]"
            if c.function is None and c.name not in REWARD_FUNCTIONS and c.name not in MODEL_COMPONENTS:
                known = ", ".join([*REWARD_FUNCTIONS, *MODEL_COMPONENTS])
                raise ValueError(f"{where}.name: unknown reward {c.name!r} (built-ins: {known}; "
                                 f"or give function: 'package.module:function')")
            if c.key in seen:
                raise ValueError(f"{where}: label {c.key!r} is also used by reward.components[{seen[c.key]}]; "
                                 f"set label: to tell them apart")
            seen[c.key] = i
            if c.function is None and c.name in REWARD_FUNCTIONS:
                check_rule_params(c.name, c.params, where)
            elif c.function is None:
                from services.reward.models import parse_params

                parse_params(c.name, c.params, where)
        return self


class RewardSettings(MeshSettings):
    reward: RewardConfig = RewardConfig()
    server: ServerConfig = ServerConfig()


@dataclass
class ScoreItem:
    """One response to score; fields as in the ScoreItem proto message."""

    id: str = ""
    prompt: str = ""
    response: str = ""
    response_ids: list[int] = field(default_factory=list)
    ground_truth: str = ""
    data_source: str = ""

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments reward functions are called with."""
        return {k: getattr(self, k) for k in SAMPLE_KWARGS}


class Scored(NamedTuple):
    """Weighted score of one item and the unweighted score of each component by label."""

    score: float
    components: dict[str, float]


class Component(Protocol):
    """What the engine needs of a reward component."""

    key: str
    weight: float

    async def score(self, items: Sequence[ScoreItem]) -> list[float]: ...

    def describe(self) -> str: ...

    async def close(self) -> None: ...


def _where(items: Sequence[ScoreItem], i: int) -> str:
    return f"items[{i}] (id {items[i].id!r})"


class RuleComponent:
    """A built-in rule function; cheap, so it runs in a thread of the service process."""

    def __init__(self, config: ComponentConfig):
        self.key, self.weight, self.name = config.key, config.weight, config.name
        self.fn, self.params = REWARD_FUNCTIONS[config.name], dict(config.params)

    def score_sync(self, items: Sequence[ScoreItem]) -> list[float]:
        out = []
        for i, item in enumerate(items):
            try:
                out.append(float(self.fn(**item.kwargs(), **self.params)))
            except ValueError as e:
                raise ValueError(f"{_where(items, i)}: {self.name}: {e}") from None
        return out

    async def score(self, items: Sequence[ScoreItem]) -> list[float]:
        return await asyncio.to_thread(self.score_sync, items)

    def describe(self) -> str:
        return f"{self.name}({', '.join(f'{k}={v!r}' for k, v in self.params.items())})"

    async def close(self) -> None:
        return None


def build_component(config: ComponentConfig, reward: RewardConfig) -> Component:
    if config.function is not None:
        from services.reward.plugins import UserFunctionComponent

        return UserFunctionComponent(config, timeout_s=reward.timeout_s, num_workers=reward.num_workers)
    if config.name in MODEL_COMPONENTS:
        from services.reward.models import build_model_component

        return build_model_component(config)
    return RuleComponent(config)


class RewardEngine:
    """Scores batches with the configured components; no gRPC here."""

    def __init__(self, settings: RewardSettings):
        self.config = settings.reward
        self.components: list[Component] = []
        if any(c.function is None and c.name in MODEL_COMPONENTS for c in self.config.components):
            from services.common.modeling import set_threads

            set_threads(self.config.num_threads)
        try:
            for i, c in enumerate(self.config.components):
                try:
                    self.components.append(build_component(c, self.config))
                except ValueError as e:
                    raise ValueError(f"reward.components[{i}] ({c.key}): {e}") from None
        except BaseException:
            self._close_now()
            raise
        log.info("reward components: %s", ", ".join(f"{c.key} x{c.weight:g}" for c in self.components))

    def validate(self, items: Sequence[ScoreItem]) -> None:
        if len(items) == 0:
            raise ValueError("items: empty batch")
        if len(items) > self.config.max_batch_size:
            raise ValueError(f"items: {len(items)} exceed reward.max_batch_size={self.config.max_batch_size}")

    async def score(self, items: Sequence[ScoreItem]) -> list[Scored]:
        """Weighted score and per-component scores of every item, in order."""
        self.validate(items)
        per_component = await asyncio.gather(*(c.score(items) for c in self.components))
        results = []
        for i in range(len(items)):
            components: dict[str, float] = {}
            total = 0.0
            for c, values in zip(self.components, per_component):
                v = float(values[i])
                if not math.isfinite(v):
                    # A NaN reward would silently poison the advantages of the whole group.
                    raise ValueError(f"{_where(items, i)}: reward component {c.key!r} returned {v}, "
                                     f"not a finite number")
                components[c.key] = v
                total += c.weight * v
            results.append(Scored(total, components))
        return results

    def info(self) -> dict[str, Any]:
        details: dict[str, Any] = {
            "components": ",".join(c.key for c in self.components),
            "max_batch_size": self.config.max_batch_size,
            "timeout_s": self.config.timeout_s,
            "num_workers": self.config.num_workers,
        }
        for c in self.components:
            details[f"component.{c.key}"] = f"weight={c.weight:g} {c.describe()}"
        return details

    @property
    def model(self) -> str:
        """Paths of the reward models served (comma-separated; "" for rule rewards only)."""
        return ",".join(p for c in self.components if (p := getattr(c, "model_path", "")))

    def _close_now(self) -> None:
        for c in self.components:
            closer = getattr(c, "close_now", None)
            if closer is not None:
                closer()

    async def close(self) -> None:
        for c in self.components:
            await c.close()
