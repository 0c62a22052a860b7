"""What the reward service takes and gives: the item to score, its score, and what a reward component is.

A reward function, built-in or user, is called as `fn(*, prompt, response, response_ids, ground_truth,
data_source, **params)` and returns a number; `SAMPLE_KWARGS` are those sample keywords. A verl reward file
(`reward.custom_function`) is called with verl's keywords instead, `VERL_KWARGS`, and may return a dict with
`score` and extra keys (logged as metrics).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, Sequence

# The keyword arguments every reward function (built-in or user) is called with.
SAMPLE_KWARGS = ("prompt", "response", "response_ids", "ground_truth", "data_source")
# verl's compute_score(data_source, solution_str, ground_truth, extra_info) keywords.
VERL_KWARGS = ("data_source", "solution_str", "ground_truth", "extra_info")


class RewardFn(Protocol):
    def __call__(self, *, prompt: str, response: str, response_ids: Sequence[int], ground_truth: str,
                 data_source: str, **params: Any) -> float: ...


@dataclass
class ScoreItem:
    """One response to score; fields as in the ScoreItem proto message."""

    id: str = ""
    prompt: str = ""
    response: str = ""
    response_ids: list[int] = field(default_factory=list)
    ground_truth: str = ""
    data_source: str = ""
    # The dataset row's extra_info (verl's schema), handed to verl-style reward functions.
    extra_info: dict[str, Any] = field(default_factory=dict)
    # Position in the Score batch, set by the engine, so errors name the sample even within a sub-batch.
    index: int = -1

    @property
    def where(self) -> str:
        """How errors name this sample: `items[3] (id 'q7-2')`."""
        return f"items[{self.index}] (id {self.id!r})"

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments reward functions are called with."""
        return {k: getattr(self, k) for k in SAMPLE_KWARGS}

    def verl_kwargs(self) -> dict[str, Any]:
        """verl's keywords: `solution_str` is the decoded response (special tokens skipped)."""
        return {"data_source": self.data_source, "solution_str": self.response, "ground_truth": self.ground_truth,
                "extra_info": dict(self.extra_info)}


class Value(NamedTuple):
    """What a component gives for one item when it is more than a number: a verl-style dict's extra keys, or
    why the item could not be scored (error set: the score means nothing)."""

    score: float
    extras: dict[str, float]
    error: str = ""


class Scored(NamedTuple):
    """Weighted score of one item, the unweighted score of each component by label, the extra keys reward
    functions returned, and why the item failed ("" = scored; a failed item's score means nothing)."""

    score: float
    components: dict[str, float]
    extras: dict[str, float] = {}
    error: str = ""


class Component(Protocol):
    """What the engine needs of a reward component (a rule, a user function, a reward model)."""

    key: str
    weight: float

    async def score(self, items: Sequence[ScoreItem]) -> list[float | Value]: ...

    def describe(self) -> str: ...

    async def close(self) -> None: ...
