"""What the reward service takes and gives: the item to score, its score, and what a reward component is.

A reward function, built-in or user, is called as `fn(*, prompt, response, response_ids, ground_truth,
data_source, **params)` and returns a number; `SAMPLE_KWARGS` are those sample keywords.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, Sequence

# The keyword arguments every reward function (built-in or user) is called with.
SAMPLE_KWARGS = ("prompt", "response", "response_ids", "ground_truth", "data_source")


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
    """What the engine needs of a reward component (a rule, a user function, a reward model)."""

    key: str
    weight: float

    async def score(self, items: Sequence[ScoreItem]) -> list[float]: ...

    def describe(self) -> str: ...

    async def close(self) -> None: ...
