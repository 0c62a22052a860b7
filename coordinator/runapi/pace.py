"""Runs that share a trainer start their steps together (docs/many_runs.md, "How runs share a trainer").

Several LoRA runs on one trainer drift apart: one generates while another trains, so the trainer runs their updates
one after another and the rollout replicas decode their rows in separate batches. Started together, their calls
meet: one decode batch for every run's prompts, one reference forward, one update pass over every run's rows
(services/trainer/coalesce.py). So before each step a run waits for the other runs on its trainer to reach their
next step too, the last one to arrive releasing them all, but never long: at most half its own last step and
ALIGN_MAX_S. A run that misses MISSES_TO_REST alignments in a row (another run of another pace, a heavy reward)
stops waiting for REST_STEPS steps, and the others do not wait for it meanwhile: a run pays for alignment at most
a few half steps before it goes its own pace again. A run alone on its trainer never waits.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

ALIGN_MAX_S = 2.0          # the longest a run waits for the others before a step
ALIGN_FRACTION = 0.5       # ... and at most this part of its own last step
MISSES_TO_REST = 2
REST_STEPS = 8


@dataclass
class _Member:
    group: str                     # the trainer it shares
    last: float | None = None      # when it last came to a step (monotonic)
    step_s: float | None = None    # the time between its last two steps
    misses: int = 0                # alignments in a row that timed out
    rest: int = 0                  # steps left that it goes alone


class StepAligner:
    """The runs of each trainer (`join` by its address, `leave` when a run ends or pauses), aligned at each step."""

    def __init__(self):
        self._members: dict[str, _Member] = {}
        self._arrived: dict[str, set[str]] = {}
        self._events: dict[str, asyncio.Event] = {}
        self.stats = {"aligned": 0, "timeouts": 0}

    def join(self, run_id: str, group: str) -> None:
        self._members[run_id] = _Member(group)

    def leave(self, run_id: str) -> None:
        member = self._members.pop(run_id, None)
        if member is not None:
            self._arrived.get(member.group, set()).discard(run_id)
            self._release_if_complete(member.group)

    def aligned(self, run_id: str) -> bool:
        """Whether the run shares its trainer with another run (its steps are aligned, `time/align` recorded)."""
        member = self._members.get(run_id)
        return member is not None and sum(m.group == member.group for m in self._members.values()) > 1

    async def align(self, run_id: str) -> float:
        """Waits until every other run of the trainer comes to its next step too (or the wait ends); seconds
        waited."""
        member = self._members.get(run_id)
        if member is None:
            return 0.0
        start = time.monotonic()
        if member.last is not None:
            member.step_s = start - member.last
        member.last = start
        if member.rest:
            member.rest -= 1
            return 0.0
        if len(self._expected(member.group)) < 2:
            return 0.0
        self._arrived.setdefault(member.group, set()).add(run_id)
        event = self._events.setdefault(member.group, asyncio.Event())
        if self._release_if_complete(member.group):
            return 0.0
        wait = min(ALIGN_MAX_S, ALIGN_FRACTION * member.step_s) if member.step_s else ALIGN_MAX_S
        try:
            await asyncio.wait_for(event.wait(), wait)
            member.misses = 0
        except asyncio.TimeoutError:
            self.stats["timeouts"] += 1
            self._arrived.get(member.group, set()).discard(run_id)
            member.misses += 1
            if member.misses >= MISSES_TO_REST:
                member.misses, member.rest = 0, REST_STEPS
                self._release_if_complete(member.group)     # the others wait for it no more
        return time.monotonic() - start

    def _expected(self, group: str) -> set[str]:
        return {r for r, m in self._members.items() if m.group == group and not m.rest}

    def _release_if_complete(self, group: str) -> bool:
        arrived = self._arrived.get(group)
        if not arrived or not self._expected(group) <= arrived:
            return False
        self._arrived[group] = set()
        self.stats["aligned"] += 1
        event = self._events.pop(group, None)
        if event is not None:
            event.set()
        return True
