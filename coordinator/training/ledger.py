"""The async loop's ledger of prompt groups (run.async_mode): what the coordinator writes as a group goes from
launched to generated to taken by a step, and how a restarted coordinator takes back the groups in flight.

A group is one prompt's n samples, named by its data position (the prompt's index in the run's prompt stream, so
unique in the run). Entries are written as the loop goes (coordinator/runapi/store.py lists the states); the one
that says a step trains on a group is written before the update, and the step's commit turns it into "trained in
step s" in the same atomic write as the step's metrics and record (store.settle). So after a crash anywhere, every
group below the committed data position was trained (or dropped, or filtered) exactly once, by the step the log
names, and every group above it is untrained: `restore` reloads the generated ones still within max_staleness,
generates again the ones that were generating, and regenerates or drops (run.stale_samples) the stale ones.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from dataclasses import dataclass, field

import numpy as np

from coordinator.training.context import RunContext
from coordinator.training.remote import Sample

log = logging.getLogger("meshrl.coordinator")

# Per-token arrays of a sample and their dtypes, kept as base64 of their bytes (a JSON list of floats is ~3x more).
ARRAYS = {"prompt_ids": np.int32, "response_ids": np.int32, "rollout_logprobs": np.float32,
          "loss_mask": np.float32, "weight_versions": np.int64}
FIELDS = ("text", "finish_reason", "weight_version", "replica", "episode")
RESTART_KEYS = ("async/groups_recovered", "async/groups_regenerated", "async/groups_dropped_stale")


def of(ctx: RunContext):
    """The run's ledger (coordinator/runapi/store.py), or None: a synchronous run, or a context opened without one."""
    return getattr(ctx, "ledger", None) if ctx.cfg.run.async_mode else None


def encode(samples: list[Sample]) -> str:
    """A group's samples as generated (before scoring), without their problem: the stream gives it back."""
    out = []
    for s in samples:
        row = {k: getattr(s, k) for k in FIELDS}
        for k, dtype in ARRAYS.items():
            value = getattr(s, k)
            if value is not None:
                row[k] = base64.b64encode(np.asarray(value, dtype=dtype).tobytes()).decode()
        out.append(row)
    return json.dumps(out)


def decode(text: str, problem, group: int) -> list[Sample]:
    samples = []
    for row in json.loads(text):
        arrays = {k: (np.frombuffer(base64.b64decode(row[k]), dtype=dtype) if k in row else None)
                  for k, dtype in ARRAYS.items()}
        samples.append(Sample(problem=problem, group=group, **{k: row[k] for k in FIELDS}, **arrays))
    return samples


async def generating(ctx: RunContext, step: int, positions: list[int]) -> None:
    """The groups at `positions` launched for `step` on the current weights."""
    ledger = of(ctx)
    if ledger is not None:
        entry = {"state": "generating", "version": ctx.weight_version, "step": step}
        await ledger.put({p: entry for p in positions})


async def generated(ctx: RunContext, step: int, position: int, samples: list[Sample]) -> None:
    """A batch's samples (groups numbered from 0 at `position`), kept with their entries."""
    ledger = of(ctx)
    if ledger is None:
        return
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group, []).append(s)
    # Encoded off the event loop: a large batch is many MB of tokens, and the run's RPCs must keep going meanwhile.
    texts = await asyncio.to_thread(lambda: {position + g: encode(ss) for g, ss in groups.items()})
    await ledger.put({position + g: {"state": "generated", "step": step, "problem": ss[0].problem.id,
                                     "version": min(s.weight_version for s in ss)} for g, ss in groups.items()}, texts)


@dataclass
class Taken:
    """The groups the step about to train took from the queue: their samples by data position, and the stale ones
    it dropped."""

    groups: dict[int, list[Sample]] = field(default_factory=dict)
    dropped: set[int] = field(default_factory=set)


async def stage_step(ctx: RunContext, taken: Taken, trained: list[Sample]) -> None:
    """Before the update: each group the step took is marked scored (it trains on it), dropped (stale) or filtered
    (algorithm.filter_groups left it out), for step ctx.step + 1; its commit settles them (store.settle)."""
    ledger = of(ctx)
    if ledger is None:
        return
    ids = {id(s) for s in trained}
    step = ctx.step + 1
    entries = {p: {"state": "scored" if any(id(s) in ids for s in ss) else "filtered", "step": step}
               for p, ss in taken.groups.items()}
    entries.update({p: {"state": "dropped", "step": step} for p in taken.dropped})
    await ledger.put(entries)
    taken.groups.clear()
    taken.dropped.clear()


@dataclass
class Restored:
    """One batch taken back from the ledger: groups reloaded, and the groups (indexes in the batch) to generate; the
    groups it has neither of were dropped as stale (marked dropped by the step that takes the batch)."""

    reloaded: dict[int, list[Sample]]
    regenerate: list[int]


async def restore(ctx: RunContext, base: int, batch_size: int, depth: int) -> tuple[list[Restored], dict]:
    """After a restart: the batches at base, base + batch_size, ... (up to `depth`, stopping at the first one the
    ledger holds nothing of) rebuilt from the ledger, and the restart counts (RESTART_KEYS). A group is reloaded when
    generated for this prompt and within max_staleness of the weights it will train on (batch i: the current
    version + i); stale, it is regenerated, or dropped under run.stale_samples: drop (unless the whole batch is
    stale: a step trains on something); generating (or missing from a batch the ledger holds), it is generated again."""
    counts = dict.fromkeys(RESTART_KEYS, 0.0)
    ledger = of(ctx)
    if ledger is None:
        return [], counts
    live = await ledger.live()
    k = ctx.cfg.run.max_staleness
    out = []
    for i in range(depth):
        position = base + i * batch_size
        held = {p - position: live[p] for p in range(position, position + batch_size) if p in live}
        if not held:
            break
        problems = ctx.data.take(batch_size, at=position)
        fresh, stale, missing = {}, [], []
        for g in range(batch_size):
            entry, text = held.get(g, ({}, None))
            if text is None or entry.get("problem") != problems[g].id:
                missing.append(g)
            elif 0 <= ctx.weight_version + i - entry["version"] <= k:
                fresh[g] = decode(text, problems[g], g)
            else:
                stale.append(g)
        drop = set(stale) if ctx.cfg.run.stale_samples == "drop" and (fresh or missing) else set()
        out.append(Restored(fresh, sorted(missing + [g for g in stale if g not in drop])))
        counts["async/groups_recovered"] += len(fresh)
        counts["async/groups_regenerated"] += len(missing) + len(stale) - len(drop)
        counts["async/groups_dropped_stale"] += len(drop)
    # Entries past the batches rebuilt were in flight too: fill() generates them again.
    rebuilt = base + len(out) * batch_size
    counts["async/groups_regenerated"] += sum(1 for p in live if p >= rebuilt)
    if any(counts.values()):
        log.info("run %s restarted with groups in flight at data position %d: %d reloaded from the ledger, %d "
                 "generated again, %d stale dropped", ctx.run_id, base, *(int(counts[k]) for k in RESTART_KEYS))
    return out, counts
