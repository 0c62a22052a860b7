"""Reward engine: scores a batch of responses with a weighted combination of reward components.

A component is a built-in rule (`services.reward.functions`), a user function (`package.module:function`,
run in a worker pool with a timeout, `services.reward.workers`), a sequence-classification reward model, or
an embedding similarity (`services.reward.models`). Each is reported unweighted under its label; the score
is the weighted sum. No gRPC here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from dataclasses import replace
from typing import Any, Sequence

from services.reward.config import ComponentConfig, RewardConfig, RewardSettings, check_component_list, list_key
from services.reward.functions import REWARD_FUNCTIONS
from services.reward.models import build_model_component
from services.reward.types import Component, Scored, ScoreItem, Value
from services.reward.workers import UserFunctionComponent

log = logging.getLogger("meshrl.reward")

# Distinct component lists of runs kept built; rules are cheap to build, the cap only bounds memory.
MAX_RUN_COMPONENT_SETS = 64


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
        return UserFunctionComponent(config, timeout_s=reward.function_timeout_s, num_workers=reward.num_workers)
    if config.is_model:
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
        # Rule components runs sent with their Score requests, by their JSON.
        self._run_components: dict[str, list[Component]] = {}
        if any(c.is_model for cs in lists.values() for c in cs):
            from services.common.tensors.modeling import set_threads

            set_threads(self.config.num_threads)
        try:
            for source, configs in lists.items():
                where = list_key(source)
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

    def run_components(self, configs: Sequence[ComponentConfig]) -> list[Component]:
        """A run's own rule components (ScoreRequest.components), built once per distinct list."""
        key = json.dumps([c.model_dump() for c in configs], sort_keys=True)
        if key not in self._run_components:
            check_component_list(configs, "components")
            for i, c in enumerate(configs):
                if c.function is not None or c.is_model:
                    raise ValueError(f"components[{i}]: {c.key!r} is not a built-in rule; reward models and user "
                                     f"functions are loaded when the reward replica starts (its reward.components)")
            if len(self._run_components) >= MAX_RUN_COMPONENT_SETS:
                self._run_components.clear()
            self._run_components[key] = [RuleComponent(c) for c in configs]
        return self._run_components[key]

    async def score(self, items: Sequence[ScoreItem], components: Sequence[ComponentConfig] | None = None
                    ) -> list[Scored]:
        """Weighted score and per-component scores of every item, in order; `components` (a run's rule
        components) replace the default list."""
        self.validate(items)
        groups = self.groups if components is None else {**self.groups, None: self.run_components(components)}
        items = [it if it.index == i else replace(it, index=i) for i, it in enumerate(items)]
        by_group: dict[str | None, list[ScoreItem]] = {}
        for it in items:
            by_group.setdefault(it.data_source if it.data_source in groups else None, []).append(it)

        async def score_group(source, group):
            components = groups[source]
            return group, components, await asyncio.gather(*(c.score(group) for c in components))

        results: list[Scored | None] = [None] * len(items)
        for group, components, per_component in await asyncio.gather(
                *(score_group(source, group) for source, group in by_group.items())):
            for row, it in enumerate(group):
                results[it.index] = self._combine(it, components, [values[row] for values in per_component])
        return results  # type: ignore[return-value]

    @staticmethod
    def _combine(item: ScoreItem, components: Sequence[Component], values: Sequence[float | Value]) -> Scored:
        """The weighted score of one item; an item a component failed on (an error, a NaN: it would silently
        poison the advantages of its whole group) is a failed Scored that says why, not a 0."""
        scores: dict[str, float] = {}
        extras: dict[str, float] = {}
        total = 0.0
        for c, value in zip(components, values):
            if isinstance(value, Value):
                if value.error:
                    return Scored(math.nan, {}, {}, value.error)
                for k, v in value.extras.items():
                    extras[f"{c.key}/{k}" if k in extras else k] = v
                value = value.score
            v = float(value)
            if not math.isfinite(v):
                return Scored(math.nan, {}, {}, f"{item.where}: reward component {c.key!r} returned {v}, not a "
                                                f"finite number")
            scores[c.key] = v
            total += c.weight * v
        return Scored(total, scores, extras)

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
