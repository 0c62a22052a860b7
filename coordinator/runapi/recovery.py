"""Exactly-once steps across restarts: bringing a reopened run and its trainer to the same run step.

The trainer records the run step (run id, step, data position after it) with each update it applies and reports
the last one (services/trainer/steps.py). A reopened run compares it with its stored record at step k:
- the trainer's last step is k: they agree, the run continues at k + 1;
- it is k + 1: the trainer applied a step the store never recorded (the coordinator died between the update and
  its commit). That step is committed now, flagged `recovered`, with the metrics the trainer kept of it (the
  update's own and those the coordinator sent with it: rewards, advantages, timings up to the update; what came
  after it, the weight sync and the step's total time, died with the coordinator), and the run continues at
  k + 2 with the prompts after it: the update is not applied twice, its prompts not reused;
- anything else (a restarted trainer lost its weights): the last checkpoint is loaded and the run is set back to
  the checkpoint's step and data position, dropping the metrics of the steps after it, which run again on the
  same prompts. Without a checkpoint a fresh trainer replays from step 0; a trainer holding other weights is
  refused by name.
A run that started from another run's checkpoint (`run.init_from`) starts from it again wherever it would replay
from step 0: a fresh trainer holds model.path's weights, not the ones the run started from.
"""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Awaitable, Callable

from coordinator.recipe import run_settings
from coordinator.runapi import checkpoints

from coordinator.runapi.store import RunRecord, RunStore
from coordinator.training import remote, reporting
from coordinator.training.context import RunContext
from services.common.errors import FailedPrecondition
from services.trainer.types import RunStart, RunStep

log = logging.getLogger("meshrl.runs")

# Commits one step's metrics: the store, metrics.jsonl and the run's metric sinks (RunManager._record).
Commit = Callable[[RunRecord, dict, RunContext], Awaitable[None]]


def applied_step(info) -> RunStep | None:
    """The trainer's record of its last applied run step, from its GetInfo details (None: it has none)."""
    d = info.details
    if not d.get("run_id"):
        return None
    return RunStep(d["run_id"], int(d.get("run_step", 0)), int(d.get("run_data_position", 0)))


async def settle_trainer(store: RunStore, record: RunRecord, ctx: RunContext, commit: Commit | None = None) -> None:
    """Makes `record`, `ctx` and the trainer agree on the run's last step (see the module docstring); a step
    committed here goes through `commit` (default: the store and metrics.jsonl)."""
    info = await remote.info(ctx.trainer)
    applied = applied_step(info)
    if applied is not None and applied.run_id == record.run_id:
        if applied.step == record.step:
            return
        if applied.step == record.step + 1:
            metrics = await _recover_step(record, ctx, applied, info)
            await (commit or _commit_to_store(store))(record, metrics, ctx)
            return
    elif record.step == 0:
        # Nothing of this run was applied: the trainer holds the weights it started from, unless it restarted
        # since a start from run.init_from (a fresh trainer holds model.path's).
        if record.init_checkpoint and info.weight_version != record.weight_version:
            await _start_again(record, ctx)
        return
    await _replay_from_checkpoint(store, record, ctx, fresh=applied is None and info.weight_version == 0)


async def _start_again(record: RunRecord, ctx: RunContext) -> int:
    """The trainer back to the run's run.init_from checkpoint, as when it started; -> the weight version."""
    applied = await run_settings.configure_trainer(ctx.trainer, ctx.cfg, reset_schedule=True,
                                                   start=RunStart(record.init_checkpoint))
    log.warning("run %s: the trainer lost the weights the run started from; it starts again from %s",
                record.run_id, applied.started_from)
    ctx.weight_version = record.weight_version = applied.weight_version
    return applied.weight_version


async def _recover_step(record: RunRecord, ctx: RunContext, applied: RunStep, info) -> dict[str, float]:
    """The run moved on to the step the trainer applied; -> that step's metrics, from the trainer's record of it."""
    weight_version = info.weight_version
    kept = step_metrics(info, applied, weight_version)
    log.warning("run %s: the trainer applied step %d before the coordinator stopped; step %d is committed as "
                "recovered (%s) and the run continues at step %d", record.run_id, applied.step, applied.step,
                "with the metrics the trainer kept" if kept else "its metrics were lost", applied.step + 1)
    ctx.step, ctx.data.position, ctx.weight_version = applied.step, applied.data_position, weight_version
    record.step, record.data_position, record.weight_version = applied.step, applied.data_position, weight_version
    every = ctx.cfg.run.checkpoint_every
    if every and ctx.step % every == 0:
        await save_checkpoint(ctx, record)
    recovered = ctx.algorithm.recovered_metrics(kept) if kept else {}
    return {**recovered, "step": float(ctx.step), "recovered": 1.0, "weight_version": float(weight_version),
            "data_position": float(ctx.data.position)}


def step_metrics(info, applied: RunStep, weight_version: int) -> dict:
    """The trainer's record of the metrics of `applied` (GetInfo details `run_step_metrics`, services/trainer/steps.py),
    {} unless it is that step's and the weight version it made is the one the trainer holds."""
    text = info.details.get("run_step_metrics", "")
    kept = json.loads(text) if text else {}
    same = (kept.get("run_id"), kept.get("step"), kept.get("weight_version")) == \
        (applied.run_id, applied.step, weight_version)
    return kept if same else {}


def _commit_to_store(store: RunStore) -> Commit:
    async def commit(record: RunRecord, metrics: dict, ctx: RunContext) -> None:
        metrics = {**{k: float(v) for k, v in metrics.items()}, "timestamp": time.time()}
        record.last_metrics = {**record.last_metrics, **{k: v for k, v in metrics.items() if math.isfinite(v)}}
        await store.commit(record, metrics)
        reporting.write_jsonl(ctx.run_dir / "metrics.jsonl", metrics)
    return commit


async def _replay_from_checkpoint(store: RunStore, record: RunRecord, ctx: RunContext, *, fresh: bool) -> None:
    if record.checkpoint_path:
        # A refused (damaged, unfinished) checkpoint falls back to the one before it, said in the message.
        restored, step, position, fallback = await checkpoints.restore_latest(store, record, ctx)
        version, source = restored.weight_version, f"checkpoint {record.checkpoint_path}{fallback}"
        log.info("run %s: trainer restored from %s (weight version %d)", record.run_id, record.checkpoint_path,
                 version)
    elif fresh and record.init_checkpoint:
        step, position, version = 0, 0, await _start_again(record, ctx)
        source = f"its run.init_from checkpoint {record.init_checkpoint}: the run has no checkpoint of its own"
    elif fresh:
        step, position, version = 0, 0, 0
        source = "the trainer's initial weights: the run has no checkpoint (run.checkpoint_every: 0)"
    else:
        raise FailedPrecondition(
            f"run {record.run_id!r}: the trainer holds no weights of step {record.step} and the run has no "
            f"checkpoint (run.checkpoint_every: 0); restart the trainer to replay the run from step 0")
    log.warning("run %s: the trainer lost the weights of step %d; replaying from step %d (data position %d) "
                "on %s", record.run_id, record.step, step, position, source)
    if record.step > step:
        record.message = f"the trainer lost its weights: steps {step + 1}..{record.step} replayed from {source}"
    record.step, record.data_position, record.weight_version = step, position, version
    ctx.step, ctx.data.position, ctx.weight_version = step, position, version
    await store.rollback(record)
    _drop_jsonl_after(ctx, step)


def _drop_jsonl_after(ctx: RunContext, step: int) -> None:
    """metrics.jsonl keeps the store's records: the steps after `step` are dropped there too."""
    path = ctx.run_dir / "metrics.jsonl"
    if path.exists():
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        kept = [line for line in lines if json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in kept))


async def save_checkpoint(ctx: RunContext, record: RunRecord) -> None:
    """The trainer's state to the run's checkpoint folder of this step, noted in `record`."""
    saved = await remote.save_checkpoint(ctx.trainer, str(ctx.run_dir / "checkpoints" / f"step_{ctx.step}"))
    note_checkpoint(record, saved)
    if ctx.adapter:         # a named adapter's save records no run step: the run's own word for it
        record.checkpoint_step, record.checkpoint_data_position = ctx.step, ctx.data.position


async def restore_adapter(store, record: RunRecord, ctx: RunContext) -> None:
    """A named adapter's run resumes on its adapter made anew (the base): from its last checkpoint's step and data
    position, or from step 0; the steps after that are dropped from its record and replayed."""
    step, position, version, source = 0, 0, ctx.weight_version, "the base (no checkpoint yet)"
    if record.checkpoint_path:
        saved = await remote.load_checkpoint(ctx.trainer, record.checkpoint_path)
        step, position = record.checkpoint_step, record.checkpoint_data_position
        version, source = saved.weight_version, f"checkpoint {record.checkpoint_path}"
    if record.step > step:
        record.message = f"adapter {ctx.adapter!r} made anew: steps {step + 1}..{record.step} replayed from {source}"
    record.step, record.data_position, record.weight_version = step, position, version
    ctx.step, ctx.data.position, ctx.weight_version = step, position, version
    await store.rollback(record)
    _drop_jsonl_after(ctx, step)


def note_checkpoint(record: RunRecord, saved) -> None:
    """The record's checkpoint fields from a SaveCheckpoint answer: the run step it holds is the trainer's word."""
    own = saved.HasField("run_step") and saved.run_step.run_id == record.run_id
    record.checkpoint_path = saved.path
    record.checkpoint_step = saved.run_step.step if own else 0
    record.checkpoint_data_position = saved.run_step.data_position if own else 0
