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
from dataclasses import dataclass, field, replace
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
    # Seconds one call of a user function (one sample) may take before the Score call fails.
    # (`timeout_s`, from PoolConfig, is the coordinator's deadline for a whole Score call.)
    function_timeout_s: float = Field(30.0, gt=0)
    # Worker processes that run user functions.
    num_workers: int = Field(2, ge=1)
    max_batch_size: int = Field(4096, ge=1)
    # torch CPU threads for reward models; unset, step times vary 20x on small machines.
    num_threads: int = Field(1, ge=1)
    # Items whose data_source is a key here are scored with that list instead of `components`
    # (verl's per-data-source reward dispatch): `{gsm8k: [{name: gsm8k}], math: [{name: boxed}]}`.
    by_data_source: dict[str, list[ComponentConfig]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_components(self) -> "RewardConfig":
        if self.function is not None:
            if "components" in self.model_fields_set:
                raise ValueError("reward.function and reward.components are both set: put the user function "
                                 "in components as {name: ..., function: ...} to combine it with others")
            name = self.function.rpartition(":")[2] or self.function
            # Direct __dict__ write: validate_assignment would re-enter this validator.
            self.__dict__["components"] = [ComponentConfig(name=name, function=self.function)]
        check_component_list(self.components, "reward.components")
        for source, components in self.by_data_source.items():
            check_component_list(components, f"reward.by_data_source.{source}")
        return self

    def component_lists(self) -> dict[str | None, list[ComponentConfig]]:
        """Component lists by data source; None is the default list (`components`)."""
        return {None: self.components, **self.by_data_source}


def check_component_list(components: Sequence[ComponentConfig], where: str) -> None:
    if not components:
        raise ValueError(f"{where}: empty; give at least one component")
    seen: dict[str, int] = {}
    for i, c in enumerate(components):
        at = f"{where}[{i}]"
        if c.function is None and c.name not in REWARD_FUNCTIONS and c.name not in MODEL_COMPONENTS:
            known = ", ".join([*REWARD_FUNCTIONS, *MODEL_COMPONENTS])
            raise ValueError(f"{at}.name: unknown reward {c.name!r} (built-ins: {known}; "
                             f"or give function: 'package.module:function')")
        if c.key in seen:
            raise ValueError(f"{at}: label {c.key!r} is also used by {where}[{seen[c.key]}]; "
                             f"set label: to tell them apart")
        seen[c.key] = i
        if c.function is None and c.name in REWARD_FUNCTIONS:
            check_rule_params(c.name, c.params, at)
        elif c.function is None:
            from services.reward.models import parse_params

            parse_params(c.name, c.params, at)


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
    # Position in the Score batch, set by the engine, so errors name the sample even within a sub-batch.
    index: int = -1

    @property
    def where(self) -> str:
        """How errors name this sample: `items[3] (id 'q7-2')`."""
        return f"items[{self.index}] (id {self.id!r})"

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


class RuleComponent:
    """A built-in rule function; cheap, so it runs in a thread of the service process."""

    def __init__(self, config: ComponentConfig):
        self.key, self.weight, self.name = config.key, config.weight, config.name
        self.fn, self.params = REWARD_FUNCTIONS[config.name], dict(config.params)

    def score_sync(self, items: Sequence[ScoreItem]) -> list[float]:
        out = []
        for item in items:
            try:
                out.append(float(self.fn(**item.kwargs(), **self.params)))
            except ValueError as e:
                raise ValueError(f"{item.where}: {self.name}: {e}") from None
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

        return UserFunctionComponent(config, timeout_s=reward.function_timeout_s, num_workers=reward.num_workers)
    if config.name in MODEL_COMPONENTS:
        from services.reward.models import build_model_component

        return build_model_component(config)
    return RuleComponent(config)


class RewardEngine:
    """Scores batches with the configured components; no gRPC here."""

    def __init__(self, settings: RewardSettings):
        self.config = settings.reward
        lists = self.config.component_lists()
        # Components by data source; None is the default list, also exposed as `self.components`.
        self.groups: dict[str | None, list[Component]] = {source: [] for source in lists}
        self.components = self.groups[None]
        if any(c.function is None and c.name in MODEL_COMPONENTS for cs in lists.values() for c in cs):
            from services.common.modeling import set_threads

            set_threads(self.config.num_threads)
        try:
            for source, configs in lists.items():
                where = "reward.components" if source is None else f"reward.by_data_source.{source}"
                for i, c in enumerate(configs):
                    try:
                        self.groups[source].append(build_component(c, self.config))
                    except ValueError as e:
                        raise ValueError(f"{where}[{i}] ({c.key}): {e}") from None
        except BaseException:
            self._close_now()
            raise
        for source, components in self.groups.items():
            log.info("reward components%s: %s", f" for data_source {source!r}" if source else "",
                     ", ".join(f"{c.key} x{c.weight:g}" for c in components))

    def validate(self, items: Sequence[ScoreItem]) -> None:
        if len(items) == 0:
            raise ValueError("items: empty batch")
        if len(items) > self.config.max_batch_size:
            raise ValueError(f"items: {len(items)} exceed reward.max_batch_size={self.config.max_batch_size}")

    async def score(self, items: Sequence[ScoreItem]) -> list[Scored]:
        """Weighted score and per-component scores of every item, in order."""
        self.validate(items)
        items = [it if it.index == i else replace(it, index=i) for i, it in enumerate(items)]
        by_group: dict[str | None, list[ScoreItem]] = {}
        for it in items:
            by_group.setdefault(it.data_source if it.data_source in self.groups else None, []).append(it)

        async def score_group(source, group):
            components = self.groups[source]
            return group, components, await asyncio.gather(*(c.score(group) for c in components))

        results: list[Scored | None] = [None] * len(items)
        for group, components, per_component in await asyncio.gather(
                *(score_group(source, group) for source, group in by_group.items())):
            for row, it in enumerate(group):
                results[it.index] = self._combine(it, components, [values[row] for values in per_component])
        return results  # type: ignore[return-value]

    @staticmethod
    def _combine(item: ScoreItem, components: Sequence[Component], values: Sequence[float]) -> Scored:
        scores: dict[str, float] = {}
        total = 0.0
        for c, value in zip(components, values):
            v = float(value)
            if not math.isfinite(v):
                # A NaN reward would silently poison the advantages of the whole group.
                raise ValueError(f"{item.where}: reward component {c.key!r} returned {v}, not a finite number")
            scores[c.key] = v
            total += c.weight * v
        return Scored(total, scores)

    def info(self) -> dict[str, Any]:
        details: dict[str, Any] = {
            "components": ",".join(c.key for c in self.components),
            "max_batch_size": self.config.max_batch_size,
            "function_timeout_s": self.config.function_timeout_s,
            "num_workers": self.config.num_workers,
        }
        for source, components in self.groups.items():
            prefix = "" if source is None else f"by_data_source.{source}."
            if source is not None:
                details[f"by_data_source.{source}"] = ",".join(c.key for c in components)
            for c in components:
                details[f"{prefix}component.{c.key}"] = f"weight={c.weight:g} {c.describe()}"
        return details

    def _all(self) -> list[Component]:
        return [c for components in self.groups.values() for c in components]

    @property
    def model(self) -> str:
        """Paths of the reward models served (comma-separated; "" for rule rewards only)."""
        return ",".join(dict.fromkeys(p for c in self._all() if (p := getattr(c, "model_path", ""))))

    def _close_now(self) -> None:
        for c in self._all():
            closer = getattr(c, "close_now", None)
            if closer is not None:
                closer()

    async def close(self) -> None:
        for c in self._all():
            await c.close()
