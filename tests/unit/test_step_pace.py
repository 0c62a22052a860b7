"""Runs sharing a trainer start their steps together (coordinator/runapi/pace.py): the last to arrive releases the
others; a run alone or on another trainer never waits; a run that does not come is waited for at most half a step,
and after two misses in a row it goes alone for a while and nobody waits for it; a run leaving releases the rest."""

from __future__ import annotations

import asyncio
import time

import pytest

from coordinator.runapi import pace
from coordinator.runapi.pace import StepAligner


def test_the_last_run_to_arrive_releases_the_others():
    async def go():
        p = StepAligner()
        for run, trainer in (("a", "t1"), ("b", "t1"), ("c", "t2")):
            p.join(run, trainer)
        assert p.aligned("a") and not p.aligned("c")
        assert await p.align("c") == 0.0                       # alone on its trainer
        first = asyncio.create_task(p.align("a"))
        await asyncio.sleep(0.2)
        assert not first.done()
        assert await p.align("b") == 0.0                       # the last one: releases a
        waited = await asyncio.wait_for(first, 1)
        assert 0.15 <= waited < 1.0 and p.stats == {"aligned": 1, "timeouts": 0}
    asyncio.run(go())


def test_a_run_that_does_not_come_is_waited_for_briefly_then_not_at_all(monkeypatch):
    monkeypatch.setattr(pace, "ALIGN_MAX_S", 0.3)
    async def go():
        p = StepAligner()
        p.join("a", "t")
        p.join("b", "t")
        # b never comes: a's first wait ends at ALIGN_MAX_S, its second at half its last step (that first wait).
        waits = [await p.align("a") for _ in range(pace.MISSES_TO_REST)]
        assert waits[0] >= 0.29 and 0.5 * waits[0] * 0.9 <= waits[1] < 0.5 * waits[0] + 0.5, waits
        assert p.stats["timeouts"] == pace.MISSES_TO_REST
        # a now goes alone for REST_STEPS steps, and b, arriving, does not wait for it (0.0: no wait at all).
        assert await p.align("a") == 0.0
        assert await asyncio.wait_for(p.align("b"), 1) == 0.0
    asyncio.run(go())


def test_a_run_leaving_releases_the_others():
    async def go():
        p = StepAligner()
        for run in "abc":
            p.join(run, "t")
        waiting = [asyncio.create_task(p.align(r)) for r in "ab"]
        await asyncio.sleep(0.1)
        assert not any(w.done() for w in waiting)
        p.leave("c")
        waited = await asyncio.wait_for(asyncio.gather(*waiting), 1)
        assert all(w < 1.0 for w in waited) and p.stats["aligned"] == 1 and not p.aligned("z")
    asyncio.run(go())


@pytest.mark.parametrize("step_s", [0.2])
def test_the_wait_is_at_most_half_the_runs_own_step(step_s):
    async def go():
        p = StepAligner()
        p.join("a", "t")
        p.join("b", "t")
        p._members["a"].last = time.monotonic() - step_s     # a's last step took step_s
        t0 = time.monotonic()
        await p.align("a")
        assert time.monotonic() - t0 < 1.0     # half of 0.2 s, not ALIGN_MAX_S (2 s)
    asyncio.run(go())
