"""Async RL's batches in flight (run.async_mode): while step t scores and trains, the generations of steps
t+1 .. t+k (k = run.max_staleness) already run, so no sample trains more than k weight versions behind.

Each batch is the prompts at its own data position (step s takes the rollout_batch_size prompts after the
s-1 committed batches), so the data position stays "prompts consumed by committed steps": a restarted
coordinator takes the batches from there again, and no prompt is trained twice. A group
(one prompt's n samples) whose oldest token is staler than k is regenerated on the current weights, or dropped
with its prompt counted (run.stale_samples). Partial rollouts (rollout.partial_rollouts) let the weight update
land inside the generations in flight; samples then carry per-token versions and their `weight_version` is the
oldest one.

The run's ledger (coordinator/training/ledger.py; in Redis with run.redis_url) follows each group from launched to
generated to taken by a step, and marks it trained in the step's own commit; a restarted coordinator reloads the
generated groups of the batches in flight (those still within max_staleness) and generates only the others.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from coordinator.recipe.data import Problem
from coordinator.training import ledger, phases
from coordinator.training.context import RunContext
from coordinator.training.remote import Sample

log = logging.getLogger("meshrl.coordinator")


@dataclass
class Batch:
    """One step's generation in flight."""

    step: int                      # the run step (1-based) that trains on it
    position: int                  # data position of its first prompt
    problems: list[Problem]
    task: asyncio.Task             # -> list[Sample]; groups it lacks (dropped as stale) are marked dropped


class InFlight:
    """The batches in flight of one run context, oldest first (ctx.prefetched)."""

    def __init__(self):
        self.batches: deque[Batch] = deque()
        # The groups the step in progress took, for its ledger marks (ledger.stage_step).
        self.taken = ledger.Taken()
        # The ledger's restart counts (ledger.RESTART_KEYS): reported by the first step after the restart, 0 after.
        self.restart = dict.fromkeys(ledger.RESTART_KEYS, 0.0)

    def cancel(self) -> None:
        for b in self.batches:
            b.task.cancel()
        self.batches.clear()


def _track(task: asyncio.Task) -> asyncio.Task:
    # A batch cancelled with its run, or failing after it, must not log "exception never retrieved".
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task


async def _generate(ctx: RunContext, step: int, position: int, problems: list[Problem],
                    groups: list[int] | None = None) -> list[Sample]:
    """The batch at `position` (only its `groups`, when given, numbered as in the batch), noted in the ledger."""
    groups = list(range(len(problems))) if groups is None else groups
    await ledger.generating(ctx, step, [position + g for g in groups])
    samples = await phases.generate(ctx, [problems[g] for g in groups], ctx.sampling_at(step),
                                    partial_rollout=ctx.cfg.rollout.partial_rollouts)
    for s in samples:
        s.group = groups[s.group]          # generate numbers the groups of its call from 0
    await ledger.generated(ctx, step, position, samples)
    return samples


def _launch(ctx: RunContext, step: int, position: int, problems: list[Problem]) -> Batch:
    return Batch(step, position, problems, _track(asyncio.create_task(_generate(ctx, step, position, problems))))


async def _rebuild(ctx: RunContext, step: int, position: int, problems: list[Problem],
                   restored: ledger.Restored) -> list[Sample]:
    """A batch taken back from the ledger after a restart: its reloaded groups and its others generated again."""
    fresh = await _generate(ctx, step, position, problems, restored.regenerate) if restored.regenerate else []
    return sorted([s for ss in restored.reloaded.values() for s in ss] + fresh, key=lambda s: s.group)


async def _restore(ctx: RunContext, batch_size: int) -> InFlight:
    """A context's first queue: the batches in flight at a restart, from the run's ledger (none at a start)."""
    flight = InFlight()
    base, depth = ctx.data.position, ctx.cfg.run.max_staleness + 1
    restored, flight.restart = await ledger.restore(ctx, base, batch_size, depth)
    for i, r in enumerate(restored):
        position = base + i * batch_size
        step = ctx.step + 1 + i
        problems = ctx.data.take(batch_size, at=position)
        task = _track(asyncio.create_task(_rebuild(ctx, step, position, problems, r)))
        flight.batches.append(Batch(step, position, problems, task))
    return flight


def fill(ctx: RunContext, batch_size: int, offset: int = 0) -> InFlight:
    """The batch at `offset` prompts past the run's committed position and the next max_staleness ones in flight
    (launched in position order). Batches that do not continue there (a rollback, a replayed step) are cancelled
    and generated again. A step takes one batch, or several under algorithm.filter_groups (offset: the prompts its
    earlier batches took); a batch's step is the one it would train in at one batch per step (its sampling seed)."""
    flight = ctx.prefetched if isinstance(ctx.prefetched, InFlight) else InFlight()
    ctx.prefetched = flight
    base = ctx.data.position + offset
    head = flight.batches[0] if flight.batches else None
    # Positions only grow from step to step, so a head at another position is a rollback or a replay.
    if head is not None and head.position != base:
        log.info("async rollouts: %d batches in flight do not follow step %d (data position %d); generating again",
                 len(flight.batches), ctx.step, base)
        flight.cancel()
    depth = ctx.cfg.run.max_staleness + 1
    have = len(flight.batches)
    if have < depth:
        problems = ctx.data.take((depth - have) * batch_size, at=base + have * batch_size)
        for i in range(have, depth):
            position = base + i * batch_size
            chunk = problems[(i - have) * batch_size:(i - have + 1) * batch_size]
            flight.batches.append(_launch(ctx, ctx.step + 1 + (position - ctx.data.position) // batch_size,
                                          position, chunk))
    return flight


async def next_batch(ctx: RunContext, batch_size: int, offset: int = 0) -> tuple[list[Sample], dict[str, float]]:
    """The samples of the batch at `offset` prompts past the committed position (none staler than
    run.max_staleness) and the `async/` metrics; in a synchronous run, a fresh generation."""
    if not ctx.cfg.run.async_mode:
        sampling = ctx.sampling_at(ctx.step + 1, offset // batch_size) if offset else None
        samples = await phases.generate(ctx, ctx.data.take(batch_size, at=ctx.data.position + offset), sampling)
        return samples, {k: v for k, v in staleness_metrics(ctx, samples).items() if not k.startswith("async/")}
    if not isinstance(ctx.prefetched, InFlight):
        ctx.prefetched = await _restore(ctx, batch_size)
    flight = fill(ctx, batch_size, offset)
    if offset == 0:                        # a step's first batch: what an earlier, failed step took is moot
        flight.taken = ledger.Taken()
    batch = flight.batches[0]
    try:
        samples = await batch.task
    finally:
        if flight.batches and flight.batches[0] is batch:
            flight.batches.popleft()
    samples, counts = await handle_stale(ctx, samples)
    kept = {s.group for s in samples}
    flight.taken.dropped |= {batch.position + g for g in range(len(batch.problems)) if g not in kept}
    for s in samples:
        flight.taken.groups.setdefault(batch.position + s.group, []).append(s)
    restart, flight.restart = flight.restart, dict.fromkeys(ledger.RESTART_KEYS, 0.0)
    return samples, {**staleness_metrics(ctx, samples), **counts, **restart,
                     "async/in_flight": float(len(flight.batches))}


async def stage_step(ctx: RunContext, samples: list[Sample]) -> None:
    """Before the step's update: the ledger marks of the groups it took (ledger.stage_step); no-op when sync."""
    if isinstance(ctx.prefetched, InFlight):
        await ledger.stage_step(ctx, ctx.prefetched.taken, samples)


async def handle_stale(ctx: RunContext, samples: list[Sample]) -> tuple[list[Sample], dict[str, float]]:
    """Groups staler than max_staleness regenerated on the current weights, or dropped (run.stale_samples); a
    batch whose every group is stale is regenerated whole either way (a step trains on something)."""
    k = ctx.cfg.run.max_staleness
    # Staleness: versions between the weights about to be updated and the oldest that produced a token; below 0,
    # weights the run no longer holds (a rollback).
    stale = sorted({s.group for s in samples if not 0 <= ctx.weight_version - s.weight_version <= k})
    counts = {"async/dropped_stale": 0.0, "async/regenerated": 0.0}
    if not stale:
        return samples, counts
    groups = sorted({s.group for s in samples})
    if ctx.cfg.run.stale_samples == "drop" and len(stale) < len(groups):
        kept = [s for s in samples if s.group not in set(stale)]
        counts["async/dropped_stale"] = float(len(samples) - len(kept))
        log.info("async rollouts: dropped %d stale groups of step %d", len(stale), ctx.step + 1)
        return kept, counts
    by_group = {s.group: s.problem for s in samples}
    fresh = await phases.generate(ctx, [by_group[g] for g in stale], ctx.sampling_at(ctx.step + 1))
    for s in fresh:
        s.group = stale[s.group]           # generate numbers the groups of its call from 0
    counts["async/regenerated"] = float(len(fresh))
    log.info("async rollouts: regenerated %d stale groups of step %d", len(stale), ctx.step + 1)
    return sorted([s for s in samples if s.group not in set(stale)] + fresh, key=lambda s: s.group), counts


def staleness_metrics(ctx: RunContext, samples: Sequence[Sample]) -> dict[str, float]:
    """Staleness of the samples about to train, in weight versions behind the weights being updated: per sample
    (its oldest token) and per token; `async/partial_samples` counts samples whose tokens span several versions."""
    lags = [ctx.weight_version - s.weight_version for s in samples]
    token_lag, tokens, partial = 0, 0, 0
    for s in samples:
        # Model tokens only: an episode's observation tokens were not sampled by any weights.
        model = np.ones(len(s.response_ids), dtype=bool) if s.loss_mask is None else np.asarray(s.loss_mask) > 0
        n = int(model.sum())
        if s.weight_versions is not None:
            versions = np.asarray(s.weight_versions)[model]
            token_lag += int(np.sum(ctx.weight_version - versions))
            partial += int(len(set(versions.tolist())) > 1)
        else:
            token_lag += (ctx.weight_version - s.weight_version) * n
        tokens += n
    return {"staleness_mean": sum(lags) / len(lags), "staleness_max": float(max(lags)),
            "staleness_token_mean": token_lag / max(tokens, 1), "async/partial_samples": float(partial)}
