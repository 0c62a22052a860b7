"""`auto` settings: a speed switch whose best value depends on the hardware resolves once, out loud.

A service resolves each of its `auto` keys in one place at start-up (`Resolved.pick`), logs the choice once
("rollout: cuda_graphs=auto -> true (CUDA device, torch engine)"), and reports every choice in GetInfo's
`details["resolved"]` (JSON). The coordinator writes them into the run's `recipe.yaml`. An explicit value always
wins; one that cannot work here is refused by the service with the key named, before it serves.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from typing import Any, Literal

AUTO = "auto"
# The type of an `auto` field: `cuda_graphs: bool | Auto = AUTO`.
Auto = Literal["auto"]


def is_auto(value: Any) -> bool:
    """`auto`, or null (the spelling these keys had before `auto`: null meant the same)."""
    return value is None or value == AUTO


@dataclass(frozen=True)
class Choice:
    """What one key resolved to, what was asked (`auto` or the explicit value) and why."""

    value: Any
    asked: Any
    why: str


class Resolved:
    """The resolved `auto` keys of one service, in the order they were resolved."""

    def __init__(self, role: str, logger: logging.Logger | None = None, *, emit: bool = True):
        self.role = role
        self.log = logger or logging.getLogger(f"meshrl.{role}")
        self.emit = emit          # False on every rank but a trainer's rank 0: one line per choice
        self.choices: dict[str, Choice] = {}

    def pick(self, key: str, asked: Any, auto_value: Any, why: str) -> Any:
        """`auto_value` when `asked` is auto (logged with `why`), else `asked`; recorded under `key` either way."""
        if is_auto(asked):
            self.choices[key] = Choice(auto_value, AUTO, why)
            if self.emit:
                self.log.info("%s: %s=auto -> %s (%s)", self.role, key, _show(auto_value), why)
            return auto_value
        self.choices[key] = Choice(asked, asked, "set explicitly")
        return asked

    def record(self, key: str, value: Any, asked: Any, why: str) -> None:
        """A choice made elsewhere (per target, later than start-up), recorded and logged once per change."""
        old = self.choices.get(key)
        choice = Choice(value, AUTO if is_auto(asked) else asked, why)
        if old != choice and self.emit:
            self.log.info("%s: %s=%s -> %s (%s)", self.role, key, _show(choice.asked), _show(value), why)
        self.choices[key] = choice

    def value(self, key: str, default: Any = None) -> Any:
        choice = self.choices.get(key)
        return default if choice is None else choice.value

    def as_dict(self) -> dict[str, dict]:
        return {k: asdict(c) for k, c in self.choices.items()}

    def json(self) -> str:
        """GetInfo's details["resolved"]."""
        return json.dumps(self.as_dict(), sort_keys=True)


def _show(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


def parse(details: dict) -> dict[str, dict]:
    """GetInfo details["resolved"] as {key: {value, asked, why}} ({} for a service that reports none)."""
    text = details.get("resolved")
    if not text:
        return {}
    try:
        data = json.loads(text)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}
