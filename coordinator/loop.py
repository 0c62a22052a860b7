"""The RL loop over the mesh. Reads top to bottom: generate -> score || reference || old logprobs ||
values -> advantages -> train -> sync weights -> record. Details live in coordinator/phases.py."""

from __future__ import annotations

import asyncio
import time

from coordinator import phases
from coordinator.phases import PhaseTimer, RunContext


async def run_step(ctx: RunContext) -> dict[str, float]:
    """One step of the configured family: RL (below) or DPO (coordinator/dpo.py)."""
    if ctx.dpo is not None:
        from coordinator import dpo

        return await dpo.dpo_step(ctx)
    return await rl_step(ctx)


async def evaluate(ctx: RunContext) -> dict[str, float]:
    """Held-out metrics: greedy task accuracy (and preference accuracy for DPO)."""
    if ctx.dpo is not None:
        from coordinator import dpo

        return await dpo.evaluate(ctx)
    return {"heldout_accuracy": await phases.evaluate(ctx)}


def data_position(ctx: RunContext) -> int:
    return ctx.dpo.train.position if ctx.dpo is not None else ctx.data.position


async def rl_step(ctx: RunContext) -> dict[str, float]:
    """One on-policy (or, in async mode, bounded-staleness) step; returns its metrics."""
    timer = PhaseTimer()
    start = time.perf_counter()
    batch_size = ctx.cfg.data.rollout_batch_size

    with timer("generate"):
        samples = await next_rollouts(ctx, batch_size)
    await phases.score_and_measure(ctx, samples, timer)
    adv_metrics = phases.compute_advantages(ctx, samples)

    if ctx.cfg.run.async_mode:
        # Step t+1's generation runs on the current weights while step t trains.
        ctx.prefetched = asyncio.create_task(
            phases.generate(ctx, ctx.data.take(2 * batch_size)[batch_size:]))
    train_metrics = await phases.train(ctx, samples, timer)
    with timer("weight_sync"):
        sync_metrics = await phases.sync_weights(ctx)

    ctx.data.advance(batch_size)
    ctx.step += 1
    ctx.last_samples = samples
    seconds = time.perf_counter() - start
    return {**phases.sample_metrics(samples), **adv_metrics, **train_metrics, **sync_metrics,
            **staleness(ctx, samples), **{f"time/{k}": v for k, v in timer.seconds.items()},
            "time/step": seconds, "samples_per_s": len(samples) / seconds,
            "data_position": float(ctx.data.position), "epoch": float(ctx.data.epoch)}


async def next_rollouts(ctx: RunContext, batch_size: int):
    """This step's samples: the prefetched batch when it is fresh enough, else a new generation."""
    task, ctx.prefetched = ctx.prefetched, None
    if task is not None:
        samples = await task
        # Samples older than the bound are regenerated, not trained on.
        if max(ctx.weight_version - s.weight_version for s in samples) <= ctx.cfg.run.max_staleness:
            return samples
    return await phases.generate(ctx, ctx.data.take(batch_size))


def staleness(ctx: RunContext, samples) -> dict[str, float]:
    # Samples were produced before this step's sync, so on-policy staleness is 0.
    lags = [ctx.weight_version - 1 - s.weight_version for s in samples]
    return {"staleness_mean": sum(lags) / len(lags), "staleness_max": float(max(lags))}
