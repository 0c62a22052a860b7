"""Stateful text environments: per-episode instances keyed by episode id, and the built-in `guess_number`."""

from __future__ import annotations

import asyncio
import inspect
import random
import re
import time
from dataclasses import dataclass
from typing import Any, Callable

from services.common.errors import NotFound, ResourceExhausted
from services.env.types import StepResult


class GuessNumber:
    """Guess a number in [low, high]: each step answers higher / lower / correct (reward 1, done), at most
    `max_steps` guesses. Small enough for tests and demos of multi-turn episodes."""

    def __init__(self):
        self.target, self.steps, self.max_steps = 0, 0, 0

    def reset(self, *, low: int = 1, high: int = 100, seed: int | None = None, max_steps: int = 8) -> str:
        if not low < high:
            raise ValueError(f"kwargs: low ({low}) must be below high ({high})")
        self.target = random.Random(seed).randint(low, high)
        self.steps, self.max_steps = 0, max_steps
        return f"I picked a number between {low} and {high}. Guess it."

    def step(self, action: str) -> StepResult:
        self.steps += 1
        numbers = re.findall(r"-?\d+", action)
        if not numbers:
            return StepResult("Say a number.", 0.0, self.steps >= self.max_steps)
        guess = int(numbers[-1])
        if guess == self.target:
            return StepResult("Correct!", 1.0, True, {"guesses": float(self.steps)})
        hint = "higher" if guess < self.target else "lower"
        return StepResult(f"{guess} is wrong, go {hint}.", 0.0, self.steps >= self.max_steps)


@dataclass
class _Episode:
    environment: str
    instance: Any
    touched: float


def as_step(value: Any, where: str) -> StepResult:
    """A step's return value: a StepResult, or a (observation, reward, done[, metrics]) tuple as gym returns."""
    if isinstance(value, StepResult):
        return value
    if isinstance(value, tuple) and len(value) in (3, 4) and isinstance(value[0], str):
        return StepResult(value[0], float(value[1]), bool(value[2]), dict(value[3]) if len(value) == 4 else {})
    raise ValueError(f"{where}: step must return a StepResult or (observation, reward, done[, metrics]), "
                     f"got {type(value).__name__}")


async def _maybe_await(fn: Callable, *args, **kwargs):
    if inspect.iscoroutinefunction(fn):
        return await fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)


class EpisodeStore:
    """Live environments by episode id, on this replica only. An episode's state goes when it is done, when the
    caller ends it, or when untouched for `ttl_s`; a Step for an episode not held here is NotFound, which the
    caller reads as "this replica lost it" (it restarted or the episode expired) and retries or fails it."""

    def __init__(self, classes: dict[str, Callable[[], Any]], *, max_episodes: int, ttl_s: float):
        self.classes = classes
        self.max_episodes = max_episodes
        self.ttl_s = ttl_s
        self.episodes: dict[str, _Episode] = {}

    async def reset(self, episode_id: str, environment: str, kwargs: dict[str, Any]) -> str:
        if not episode_id:
            raise ValueError("episode_id: must be set")
        if environment not in self.classes:
            raise ValueError(f"environment: unknown environment {environment!r} (here: {', '.join(self.classes)})")
        self._expire()
        await self.end(episode_id)
        if len(self.episodes) >= self.max_episodes:
            raise ResourceExhausted(f"episode_id: this replica holds env.max_episodes={self.max_episodes} episodes")
        instance = self.classes[environment]()
        try:
            observation = await _maybe_await(instance.reset, **kwargs)
        except TypeError as e:
            raise ValueError(f"kwargs_json: {environment}.reset: {e}") from None
        self.episodes[episode_id] = _Episode(environment, instance, time.monotonic())
        return str(observation)

    async def step(self, episode_id: str, action: str) -> StepResult:
        episode = self.episodes.get(episode_id)
        if episode is None:
            raise NotFound(f"episode_id: no episode {episode_id!r} on this replica (never reset here, ended, "
                           f"expired after env.episode_ttl_s, or the replica restarted)")
        episode.touched = time.monotonic()
        result = as_step(await _maybe_await(episode.instance.step, action), f"environment {episode.environment!r}")
        if result.done:
            await self.end(episode_id)
        return result

    async def end(self, episode_id: str) -> bool:
        episode = self.episodes.pop(episode_id, None)
        if episode is not None and hasattr(episode.instance, "close"):
            await _maybe_await(episode.instance.close)
        return episode is not None

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        for key in [k for k, e in self.episodes.items() if e.touched < cutoff]:
            self.episodes.pop(key, None)

    async def close(self) -> None:
        for key in list(self.episodes):
            await self.end(key)
