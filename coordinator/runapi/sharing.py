"""Many runs on one mesh (docs/many_runs.md): who holds each trainer (LoRA runs side by side, each its own named
adapter; a full-parameter run alone), and weighted fair scheduling of the shared rollout/reward/reference pools.

A trainer's first run trains its run adapter ("" on the wire: exactly the single-run path); every LoRA run that
starts beside it gets a named adapter (`adapter_name`), created at StartRun and deleted when the run ends.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from services.common.errors import FailedPrecondition

# The pools runs share; each has its own scheduler.
SHARED_ROLES = ("rollout", "reward", "reference")
# Calls in flight per pool, all runs together, before contending runs are granted by priority: at least
# DEFAULT_POOL_CALLS, and CALLS_PER_REPLICA per replica of the largest pool a run reaches through it (a step's generate
# fans out one call per replica: two runs on 16 replicas would otherwise share 8 slots and leave half the pool idle).
DEFAULT_POOL_CALLS = 8
CALLS_PER_REPLICA = 2


def adapter_name(run_id: str) -> str:
    """The run's stable adapter name on the trainer: its id in the adapter alphabet, shortened with a digest."""
    clean = re.sub(r"[^A-Za-z0-9_-]", "-", run_id).lstrip("-_") or "run"
    if len(clean) <= 64 and clean == run_id:
        return clean
    return f"{clean[:55]}-{hashlib.sha1(run_id.encode()).hexdigest()[:8]}"


@dataclass
class Holder:
    run_id: str
    adapter: str
    lora: bool | None       # None while the run opens (the trainer's LoRA settings are read as it settles)


class TrainerClaims:
    """Which runs hold which trainer. LoRA runs share one (each on its adapter); a full-parameter run holds it alone."""

    def __init__(self):
        self.holders: dict[str, list[Holder]] = {}

    def claim(self, run_id: str, address: str, lora_asked: bool | None) -> str:
        """Reserves the trainer at `address` for the run; -> its adapter ("" = the trainer's run adapter).
        lora_asked: the run's recipe's actor.lora (None: not set, the trainer's holds)."""
        others = self.holders.get(address, [])
        if not others:
            self.holders[address] = [Holder(run_id, "", lora_asked)]
            return ""
        names = ", ".join(repr(h.run_id) for h in others)
        opening = [h.run_id for h in others if h.lora is None]
        if opening:
            raise FailedPrecondition(f"trainer.address: the trainer at {address} is opening run {opening[0]!r}; "
                                     f"start this run once that one runs (its trainer's LoRA settings are read then)")
        if not all(h.lora for h in others):
            raise FailedPrecondition(f"trainer.address: the trainer at {address} is training full-parameter run "
                                     f"{names}; a full-parameter run holds its trainer alone (stop that run or "
                                     f"wait for its end, or start another trainer)")
        if lora_asked is False:
            raise FailedPrecondition(f"actor.lora: the trainer at {address} trains LoRA runs {names}; a "
                                     f"full-parameter run cannot run beside them (it would change their base)")
        holder = Holder(run_id, adapter_name(run_id), True)
        others.append(holder)
        return holder.adapter

    def settled(self, run_id: str, address: str, lora: bool) -> None:
        """The run opened: whether it trains LoRA (its effective actor.lora) is known."""
        for h in self.holders.get(address, []):
            if h.run_id == run_id:
                h.lora = lora

    def holds(self, run_id: str, address: str, adapter: str, lora: bool) -> None:
        """A resumed run takes its place again (its adapter as recorded)."""
        self.release(run_id)
        self.holders.setdefault(address, []).append(Holder(run_id, adapter, lora))

    def others(self, run_id: str, address: str) -> list[str]:
        """The runs beside `run_id` on the trainer at `address`."""
        return [h.run_id for h in self.holders.get(address, []) if h.run_id != run_id]

    def release(self, run_id: str) -> None:
        for address, holders in list(self.holders.items()):
            holders[:] = [h for h in holders if h.run_id != run_id]
            if not holders:
                del self.holders[address]


@dataclass
class _Share:
    priority: float
    limit: int                                   # 0 = no cap of its own
    order: int
    vtime: float = 0.0                           # virtual time: grants so far / priority
    active: int = 0
    granted: int = 0
    waiting: deque = field(default_factory=deque)


class FairScheduler:
    """Grants one pool's calls to runs: any call goes at once while at most `capacity` are in flight and no other run
    waits; beyond that, the waiting run with the least granted/priority (weighted fair queueing) goes next, so over
    a contended stretch each run gets calls in proportion to its priority. A run's own cap (`limit`) holds always."""

    def __init__(self, capacity: int = DEFAULT_POOL_CALLS):
        if capacity < 1:
            raise ValueError(f"pool_calls: must be >= 1, got {capacity}")
        self.floor = self.capacity = capacity
        self.in_flight = 0
        self.clock = 0.0                          # the virtual time of the last grant
        self.shares: dict[str, _Share] = {}
        self._joined = 0

    def join(self, run_id: str, priority: float = 1.0, limit: int = 0) -> None:
        if priority <= 0:
            raise ValueError(f"run.priority: must be > 0, got {priority}")
        self._joined += 1
        self.shares[run_id] = _Share(priority, limit, self._joined, vtime=self.clock)

    def leave(self, run_id: str) -> None:
        share = self.shares.pop(run_id, None)
        if share is not None:
            for fut in share.waiting:
                fut.cancel()
            self.in_flight -= share.active
            self._dispatch()

    def granted(self, run_id: str) -> int:
        return self.shares[run_id].granted

    def replicas_seen(self, count: int) -> None:
        """A pool of `count` replicas is called through this scheduler: capacity grows to CALLS_PER_REPLICA each
        (never below the floor it was made with; it does not shrink when replicas leave, as calls may be in flight)."""
        wanted = max(self.floor, CALLS_PER_REPLICA * count)
        if wanted > self.capacity:
            self.capacity = wanted
            self._dispatch()

    @asynccontextmanager
    async def slot(self, run_id: str):
        """One call's slot: waits its turn, released when the call returns or fails."""
        share = self.shares.get(run_id)
        if share is None:                         # a run that never joined (a test's context) is not scheduled
            yield
            return
        await self._acquire(share)
        try:
            yield
        finally:
            self._release(run_id, share)

    async def _acquire(self, share: _Share) -> None:
        fut = asyncio.get_running_loop().create_future()
        if not share.waiting and not share.active:
            share.vtime = max(share.vtime, self.clock)    # an idle run banks no credit for the time it was idle
        share.waiting.append(fut)
        self._dispatch()
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():        # granted as it was cancelled: give the slot back
                share.active -= 1
                self.in_flight -= 1
                self._dispatch()
            else:
                fut.cancel()
            raise

    def _release(self, run_id: str, share: _Share) -> None:
        if self.shares.get(run_id) is share:
            share.active -= 1
            self.in_flight -= 1
            self._dispatch()

    def _dispatch(self) -> None:
        while True:
            ready = [s for s in self.shares.values() if s.waiting and (not s.limit or s.active < s.limit)]
            if not ready or (self.in_flight >= self.capacity and len(self.shares) > 1):
                return
            share = min(ready, key=lambda s: (s.vtime, s.order))
            fut = share.waiting.popleft()
            if fut.cancelled():
                continue
            share.active += 1
            share.granted += 1
            self.in_flight += 1
            self.clock = share.vtime
            share.vtime += 1.0 / share.priority
            fut.set_result(None)


class ScheduledPool:
    """A run's view of a shared pool: the same ReplicaPool, its `call`s granted by the pool's FairScheduler."""

    def __init__(self, pool, scheduler: FairScheduler, run_id: str):
        self._pool = pool
        self._scheduler = scheduler
        self._run_id = run_id

    def __getattr__(self, name: str):
        return getattr(self._pool, name)

    async def call(self, fn, *args, **kwargs):
        self._scheduler.replicas_seen(len(getattr(self._pool, "replicas", ())))
        async with self._scheduler.slot(self._run_id):
            return await self._pool.call(fn, *args, **kwargs)
