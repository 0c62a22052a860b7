"""DAPO's dynamic sampling (algorithm.filter_groups): a step generates batches of data.rollout_batch_size prompts and
keeps the prompt groups whose metric varies across their samples (a group whose samples all score the same has
advantage 0 under the group estimators: it teaches nothing), until it holds rollout_batch_size groups or has made
max_num_gen_batches batches (0: no bound).

Every prompt generated is consumed: the step's data position moves past every batch it made, the dropped groups and
the kept groups beyond rollout_batch_size (trimmed, as verl trims) included, so a resumed run never trains on them
and never generates them again (exactly-once, as without the filter). In async mode the batches come from the
in-flight queue (coordinator/training/async_rollouts.py), which keeps generating ahead while a step filters.

A step that reaches the bound short trains on the groups it kept (verl raises instead), said once per run and
counted in every step's `train/num_groups_short`; one that kept none trains on its last batch as it is (every
advantage 0, as without the filter; coordinator/recipe/no_signal.py warns when that goes on).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

from coordinator.training import async_rollouts, faults, ledger, phases, reporting
from coordinator.training.context import PhaseTimer, RunContext
from coordinator.training.remote import Sample

log = logging.getLogger("meshrl.coordinator")

# algorithm.filter_groups.metric -> a scored sample's value (keys are FilterGroupsConfig.metric's values).
METRICS: dict[str, Callable[[Sample], float]] = {
    "acc": reporting.success,                               # the reward's `acc`, else its score
    "score": lambda s: s.reward - s.overlong_penalty,       # the reward service's score
    "seq_reward": lambda s: s.reward,                       # ... plus the overlong penalty
}


def varied_groups(samples: list[Sample], metric: str, *, tol: float = 1e-6) -> set[int]:
    """The groups whose scored samples do not all have the same metric value (within tol, as
    advantages.zero_variance_fraction counts them); a group with fewer than 2 scored samples has no variance."""
    values: dict[int, list[float]] = {}
    for s in samples:
        if not s.reward_error:
            values.setdefault(s.group, []).append(METRICS[metric](s))
    return {g for g, v in values.items() if len(v) >= 2 and max(v) - min(v) > tol}


@dataclass
class GroupFilter:
    """The groups a step keeps, one scored generation batch at a time (`add`) until `done`."""

    target: int                    # groups per step (data.rollout_batch_size)
    metric: str
    max_batches: int               # 0 = no bound
    kept: list[list[Sample]] = field(default_factory=list)
    last: list[Sample] = field(default_factory=list)
    num_batches: int = 0
    num_groups: int = 0
    num_dropped: int = 0

    def add(self, samples: list[Sample]) -> None:
        """One generation batch (its groups numbered within it), scored."""
        self.num_batches += 1
        self.last = samples
        by_group: dict[int, list[Sample]] = {}
        for s in samples:
            by_group.setdefault(s.group, []).append(s)
        varied = varied_groups(samples, self.metric)
        self.num_groups += len(by_group)
        self.num_dropped += len(by_group) - len(varied)
        self.kept += [by_group[g] for g in sorted(varied)]

    @property
    def done(self) -> bool:
        return len(self.kept) >= self.target or 0 < self.max_batches <= self.num_batches

    def batch(self) -> list[Sample]:
        """What the step trains on: the first `target` kept groups, numbered 0.. in order, or the last batch as it is
        when none was kept."""
        if not self.kept:
            return self.last
        out = []
        for i, group in enumerate(self.kept[:self.target]):
            for s in group:
                s.group = i
                out.append(s)
        return out

    def metrics(self) -> dict[str, float]:
        return {"train/num_gen_batches": float(self.num_batches),
                "train/frac_groups_dropped": self.num_dropped / max(self.num_groups, 1),
                "train/num_groups": float(len({s.group for s in self.batch()})),
                "train/num_groups_short": float(max(0, self.target - len(self.kept)))}


async def generate_and_score(ctx: RunContext, batch_size: int,
                             timer: PhaseTimer) -> tuple[list[Sample], dict[str, float], int]:
    """The step's samples, scored, with their model forwards (reference, old log-probs, values), the generation
    metrics, and the prompts the step consumed (the data position moves by them)."""
    fg = ctx.cfg.algorithm.filter_groups
    if not fg.enable:
        with timer("generate"):
            # Async mode: the next max_staleness steps' batches generate while this one scores and trains.
            samples, metrics = await async_rollouts.next_batch(ctx, batch_size)
        faults.kill_point("after_generate", ctx.step + 1)
        await phases.score_and_measure(ctx, samples, timer)
        consumed = batch_size
    else:
        f = GroupFilter(batch_size, fg.metric, fg.max_num_gen_batches)
        samples, metrics = await _gather(ctx, batch_size, timer, f)
        faults.kill_point("after_generate", ctx.step + 1)
        await phases.score_and_measure(ctx, samples, timer, scored=True)
        consumed = f.num_batches * batch_size
    if ctx.cfg.algorithm.overlong_buffer.enable:
        penalties = [s.overlong_penalty for s in samples if not s.reward_error] or [0.0]
        metrics["reward/overlong_penalty"] = sum(penalties) / len(penalties)
        metrics["reward/frac_overlong"] = sum(p < 0 for p in penalties) / len(penalties)
    return samples, metrics, consumed


async def _gather(ctx: RunContext, batch_size: int, timer: PhaseTimer,
                  f: GroupFilter) -> tuple[list[Sample], dict[str, float]]:
    """Generation batches, each scored and filtered, until the filter is done; -> (the kept samples, metrics)."""
    counts = {"async/dropped_stale": 0.0, "async/regenerated": 0.0, **dict.fromkeys(ledger.RESTART_KEYS, 0.0)}
    metrics: dict[str, float] = {}
    while not f.done:
        with timer("generate"):
            samples, metrics = await async_rollouts.next_batch(ctx, batch_size, offset=f.num_batches * batch_size)
        for k in counts:
            counts[k] += metrics.get(k, 0.0)
        with timer("reward"):
            await phases.score_shaped(ctx, samples)
        f.add(samples)
        log.info("step %d: generation batch %d kept %d of %d groups with %s variance (%d of %d kept so far)",
                 ctx.step + 1, f.num_batches, len(varied_groups(samples, f.metric)),
                 len({s.group for s in samples}), f.metric, min(len(f.kept), f.target), f.target)
    _say_short(ctx, f)
    kept = f.batch()
    # Staleness of what trains, not of the last batch alone.
    staleness = async_rollouts.staleness_metrics(ctx, kept)
    if not ctx.cfg.run.async_mode:
        staleness = {k: v for k, v in staleness.items() if not k.startswith("async/")}
        counts = {}
    return kept, {**metrics, **staleness, **counts, **f.metrics()}


def _say_short(ctx: RunContext, f: GroupFilter) -> None:
    """Once per run: the bound was reached short, and what the step trains on instead."""
    if len(f.kept) >= f.target or "filter_groups_short" in ctx.said:
        return
    ctx.said.add("filter_groups_short")
    what = (f"trains on the {len(f.kept)} it kept" if f.kept else
            "kept none and trains on its last batch as it is (every advantage 0)")
    log.warning("step %d: algorithm.filter_groups.max_num_gen_batches=%d reached with %d of %d groups with %s "
                "variance; the step %s (verl stops the run here). Later short steps are counted in "
                "train/num_groups_short", ctx.step + 1, f.max_batches, len(f.kept), f.target, f.metric, what)
