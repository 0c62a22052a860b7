"""Builds the engine `rollout.engine` names, importing only that engine's module (config.ENGINES)."""

from __future__ import annotations

import importlib

from services.rollout.config import ENGINES, RolloutSettings
from services.rollout.types import RolloutEngine


def build_engine(settings: RolloutSettings) -> RolloutEngine:
    """The engine `rollout.engine` names, built from these settings."""
    name = settings.rollout.engine
    module_name, _, class_name = ENGINES[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"rollout.engine: {name!r} is not available here ({e}); use one of "
                         f"{', '.join(repr(n) for n in ENGINES if n != name)}") from None
    return getattr(module, class_name)(settings)
