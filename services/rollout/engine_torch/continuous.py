"""Continuous batching for the torch engine's CUDA-graph decode (rollout.continuous_batching).

A Generate request that arrives while a graph decode runs does not wait for the whole batch: at the decode's
next sync its rows take the batch rows of rows that ended (GraphDecoder.decode's join), and every request is
answered from the decode thread as soon as its own rows ended, while the decode goes on for the others. So a
long tail no longer holds the next requests' rows, nor the requests that ended before it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, Callable

import torch

from services.rollout.engine_torch.decode_join import Joiner, Room


def fill_row(row, tokens: list[int], logprobs: list[float], stopped: bool, top) -> None:
    """A graph decode's output of one row into the engine's row."""
    row.tokens, row.logprobs = tokens, logprobs
    row.finish_reason = "stop" if stopped else "length"
    if row.sampling.top_logprobs and top is not None:
        row.top = [step[:row.sampling.top_logprobs] for step in top]


class Flight:
    """The requests one engine worker call serves (those it started with and those that joined): each is answered
    from the worker thread as soon as all its rows ended."""

    def __init__(self, partial: str, results_of: Callable[[Any, list], list]):
        self.partial = partial                 # the call's partial-rollout mode: joiners must share it
        self._results_of = results_of          # (job, its rows) -> its PromptResults
        self.jobs: list = []
        self.rows: list = []
        self.results: dict[int, list] = {}     # id(job) -> its results, once all its rows ended
        self._job_of: dict[int, Any] = {}      # id(row) -> its job, until the row ended
        self._rows_of: dict[int, list] = {}
        self._left: dict[int, int] = {}

    def add(self, job, rows: list) -> list:
        self.jobs.append(job)
        self.rows += rows
        self._rows_of[id(job)], self._left[id(job)] = rows, len(rows)
        self._job_of.update((id(r), job) for r in rows)
        return rows

    def ended(self, rows: list) -> None:
        """Rows whose outputs are final; answers the requests whose rows all ended (each row counts once)."""
        for row in rows:
            job = self._job_of.pop(id(row), None)
            if job is None:
                continue
            self._left[id(job)] -= 1
            if not self._left[id(job)]:
                results = self.results[id(job)] = self._results_of(job, self._rows_of[id(job)])
                _answer(job.future, results, None)

    def fail(self, error: BaseException) -> None:
        """The worker failed: every request not answered yet gets the error."""
        for job in self.jobs:
            if id(job) not in self.results:
                _answer(job.future, None, error)


class Joining:
    """The join and ended callbacks of the graph decodes of one engine call: rows of the oldest pending requests
    that the running graph can take, in request order (a request never passes an older one that cannot join, so
    that one is decoded next once the batch drains)."""

    def __init__(self, engine, flight: Flight, rows: list):
        self.engine, self.flight = engine, flight
        self.queue: deque = deque()            # rows of taken requests that found no batch row yet
        self.ids: list = []                    # decoder row id -> row
        self.live: dict[int, Any] = {}         # rows decoding (partial rollouts tag weight swaps on them)
        self.restart(rows)

    def restart(self, rows: list) -> None:
        self.ids, self.live = list(rows), {id(r): r for r in rows}

    def next_rows(self, n: int) -> list:
        """Up to n queued rows for the next decode (the ones that found no batch row in the last)."""
        return [self.queue.popleft() for _ in range(min(n, len(self.queue)))]

    def __call__(self, room: Room) -> list[Joiner]:
        take = self.take(room)
        self.ids += take
        return [Joiner(r.prompt, r.budget, r.sampling.temperature, r.sampling.top_p, r.slot) for r in take]

    def take(self, room: Room) -> list:
        """The engine rows that join now (their version set, counted in joined_rows)."""
        if self._swap_waits():
            return []              # an update waits for the engine lock: let the batch drain so it lands
        take = []
        while len(take) < room.free and (self.queue or self._take_request(room)):
            row = self.queue[0]
            p = row.sampling
            if not (room.takes(p.temperature, p.top_p, p.top_logprobs) and room.fits(len(row.prompt), row.budget)):
                break
            take.append(self.queue.popleft())
        e = self.engine
        for row in take:
            row.version, row.start = e.weight_version, room.step
            self.live[id(row)] = row
        e.stats["joined_rows"] += len(take)
        return take

    def waiting(self, room: Room) -> bool:
        """Whether rows could join now (taken rows queued, or the oldest pending request may join): a paged decode
        then settles its window before launching the next, so they are admitted at its end."""
        if self.queue:
            return True
        if self._swap_waits():
            return False
        with self.engine._pending_mutex:
            return bool(self.engine._pending) and self._may_join(self.engine._pending[0], room)

    def _swap_waits(self) -> bool:
        e = self.engine
        with e._swaps_mutex:
            return self.flight.partial == "off" and bool(e._swaps)

    def _may_join(self, job, room: Room) -> bool:
        p = job.batch.sampling
        return not (job.future is None or job.future.done() or p.seed is not None or p.stop
                    or job.batch.partial_rollout != self.flight.partial
                    or not room.takes(p.temperature, p.top_p, p.top_logprobs))

    def _take_request(self, room: Room) -> bool:
        """Moves the oldest pending request's rows to the queue when they may join this decode."""
        e = self.engine
        with e._pending_mutex:
            if not e._pending or not self._may_join(e._pending[0], room):
                return False
            job = e._pending.pop(0)
        self.queue.extend(self.flight.add(job, e._rows_of(job)))
        return True

    def ended(self, outs: dict[int, tuple]) -> None:
        rows = []
        for i, out in outs.items():
            row = self.ids[i]
            fill_row(row, *out)
            rows.append(row)
        self.rows_ended(rows)

    def rows_ended(self, rows: list) -> None:
        """Rows whose outputs are filled in: their requests are answered once all their rows ended."""
        for row in rows:
            self.live.pop(id(row), None)
        self.flight.ended(rows)


def graph_decode(engine, rows: list, flight: Flight) -> None:
    """The engine's graph decode with continuous batching: rows of pending requests join at syncs and rows are
    answered as they end; rows of a joined request that found no batch row before the cache ran out decode
    next, in this same call."""
    joining, partial = Joining(engine, flight, rows), flight.partial != "off"
    while rows:
        # A seeded row's Philox key: the first draw of its generator (a hash of seed, prompt and sample index).
        seeds = [int(torch.randint(0, 2**62, (1,), generator=r.generator)) if r.generator is not None else None
                 for r in rows]
        engine._graph_decoder.decode(
            [r.prompt for r in rows], [r.budget for r in rows], [r.sampling.temperature for r in rows],
            [r.sampling.top_p for r in rows], seeds=seeds, top_logprobs=max(r.sampling.top_logprobs for r in rows),
            slots=[r.slot for r in rows],
            between_steps=(lambda i: engine._between_steps(list(joining.live.values()), i + 2)) if partial else None,
            join=joining, ended=joining.ended)
        rows = joining.next_rows(engine.max_batch_size)
        version = engine._swap_point() if partial else engine.weight_version
        for row in rows:
            row.version = version
        joining.restart(rows)


async def answer_of(future: asyncio.Future, run: asyncio.Future):
    """The lock holder's wait for its request's answer (with continuous batching it may come before the decode
    ends); cancelled, it still waits for the decode's thread, as the engine's _run_locked does."""
    try:
        await asyncio.wait({future, run}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        while not run.done():
            try:
                await asyncio.wait({run})
            except asyncio.CancelledError:
                pass
        raise
    return await future


def _answer(future: asyncio.Future | None, result, error: BaseException | None) -> None:
    """Sets a request's future from the worker thread, in its event loop (gone: nobody waits)."""
    if future is None:
        return
    try:
        future.get_loop().call_soon_threadsafe(_settle, future, result, error)
    except RuntimeError:           # the loop closed
        pass


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
