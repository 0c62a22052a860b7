"""Run manager: starts, steps, pauses, stops and resumes runs, keeping their state in the store."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from pathlib import Path

import yaml

from coordinator.recipe import run_settings

from coordinator.training import faults, phases, remote, reporting

from coordinator.recipe.config import RunConfig
from coordinator.recipe.preflight import check_run
from coordinator.runapi import checkpoints, observe, recovery, sharing
from coordinator.runapi.store import UNFINISHED, RunRecord, RunStore
from coordinator.training.algorithms import open_context
from coordinator.training.context import RunContext, TrainerUnavailable
from coordinator.recipe.no_signal import NoSignalWatch
from services.common.config import load_config, yaml_error
from services.common.errors import FailedPrecondition, NotFound, Unavailable
from services.trainer.types import RunStart

log = logging.getLogger("meshrl.runs")


def parse_run_config(text: str) -> RunConfig:
    """YAML/JSON text -> RunConfig; ValueError names the bad key."""
    try:
        data = yaml.safe_load(text) if text.strip() else {}
    except yaml.YAMLError as e:
        raise ValueError(f"config: invalid YAML{yaml_error(e)}") from None
    if not isinstance(data, dict):
        raise ValueError("config: top level must be a mapping of sections")
    return load_config(RunConfig, data=data)


def check_run_id(run_id: str, key: str) -> None:
    """A run id names its folder under run.run_dir: one that is a path ('x/../other-run', '..') would write into
    another run's folder or outside run_dir, so it is refused by the key that set it (INVALID_ARGUMENT)."""
    if run_id in (".", "..") or any(c in "/\\" or ord(c) < 32 for c in run_id):
        raise ValueError(f"{key}: {run_id!r} cannot name a run (it names the run's folder: no '/', '\\', "
                         f"control characters, '.' or '..')")


class RunManager:
    """Owns the asyncio task of every active run; the gRPC servicer and tests call it directly."""

    def __init__(self, store: RunStore, registry=None, defaults=None, pool_calls: int = sharing.DEFAULT_POOL_CALLS,
                 run_dir: str = "runs"):
        self.store = store
        # The coordinator's run.run_dir: where a run whose config sets none writes its folder.
        self.run_dir = run_dir
        self.registry = registry
        # The mesh's replicas (coordinator/runapi/default_pools.py): a run's roles that list no servers use them.
        self.defaults = defaults
        self.tasks: dict[str, asyncio.Task] = {}
        self.contexts: dict[str, RunContext] = {}
        self._changed: dict[str, asyncio.Condition] = {}
        self.sinks: dict = {}
        self.no_signal: dict[str, NoSignalWatch] = {}    # per run: the zero-reward-variance warning, once
        # Many runs on one mesh (coordinator/runapi/sharing.py): who holds each trainer, and the shared pools' turns.
        self.claims = sharing.TrainerClaims()
        self.schedulers = {role: sharing.FairScheduler(pool_calls) for role in sharing.SHARED_ROLES}

    def _cond(self, run_id: str) -> asyncio.Condition:
        return self._changed.setdefault(run_id, asyncio.Condition())

    async def _notify(self, run_id: str) -> None:
        cond = self._cond(run_id)
        async with cond:
            cond.notify_all()

    def _with_run_dir(self, cfg: RunConfig, run_dir: str = "") -> RunConfig:
        """A run config that sets no run.run_dir gets the coordinator's (or `run_dir`, a resumed run's folder's
        parent): a StartRun with an empty config lands where `meshrl mesh --run-dir` puts runs, not in the cwd."""
        if "run_dir" in cfg.run.model_fields_set:
            return cfg
        return cfg.model_copy(update={"run": cfg.run.model_copy(update={"run_dir": run_dir or self.run_dir})})

    async def start_run(self, config_text: str, run_id: str = "") -> str:
        # The checks `meshrl up` makes, on the keys this config sets, before any service is called; the keys it
        # leaves out come from the running services and are checked with them (run_settings.settle).
        cfg = parse_run_config(config_text)
        keys = set(run_settings.user_keys(cfg))
        cfg = self._with_run_dir(cfg)
        check_run(cfg, files="coordinator", keys=keys)
        check_run_id(*((run_id, "run_id") if run_id else (cfg.run.name, "run.name")))   # run.name starts a new id
        run_id = run_id or f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        if await self.store.get(run_id):
            raise ValueError(f"run_id: run {run_id!r} already exists")
        # Refused by name before any service is called: an init_from that names no run and no checkpoint.
        checkpoint, from_run = await checkpoints.resolve_init_from(cfg.run.init_from, self.store, cfg.run.run_dir)
        # Connect before accepting, so an unreachable server list fails StartRun itself (after the run's data is
        # read, so a bad dataset is named first). The trainer (the mesh's when the recipe names none) must be free;
        # it sets the run's starting weights: model.path's (reloaded if another run trained them) or the checkpoint's.
        try:
            ctx = await open_context(run_id, cfg, registry=self.registry, defaults=self.defaults,
                                     start=RunStart(checkpoint), claim=lambda c: self._claim(run_id, c))
        except TrainerUnavailable as e:
            # Nothing started: an unreachable trainer is the recipe's address, named as the pools' servers are
            # (not INTERNAL, nor UNAVAILABLE, which a client's retry policy would send again).
            self.claims.release(run_id)
            raise ValueError(f"trainer.address: no trainer answers at {cfg.trainer.address} ({e})") from None
        except BaseException:
            self.claims.release(run_id)
            raise
        self.claims.settled(run_id, ctx.cfg.trainer.address, ctx.cfg.actor.lora is not None)
        if ctx.adapter:
            await self._first_push(ctx, run_id)
        else:
            # The weights' version (past every version before, when they were reset): replicas holding any other
            # get them pushed before the run's first generate, and async staleness is measured against it.
            ctx.weight_version = (await remote.info(ctx.trainer)).weight_version
        started_from = f"{from_run} (weights loaded, optimizer state cleared)" if from_run else ctx.started_from
        log.info("run %s starts from %s", run_id, started_from or "the trainer's weights")
        record = RunRecord(run_id=run_id, config=config_text, state="RUNNING", num_steps=cfg.run.num_steps,
                           run_dir=str(ctx.run_dir), effective_config=run_settings.config_text(ctx.cfg),
                           weight_version=ctx.weight_version, started_from=started_from,
                           init_checkpoint=checkpoint, adapter=ctx.adapter)
        await self.store.put(record)
        ctx.ledger = self.store.ledger(run_id)
        self._launch(record, ctx)
        return run_id

    def _claim(self, run_id: str, cfg: RunConfig) -> str:
        """The trainer for the run: its run adapter when free, a named adapter beside LoRA runs; a full-parameter
        run beside any other is refused by name (sharing.TrainerClaims)."""
        return self.claims.claim(run_id, cfg.trainer.address, True if cfg.actor.lora is not None else None)

    async def _first_push(self, ctx: RunContext, run_id: str) -> None:
        """A named adapter's run: its adapter to every rollout replica before it generates; a replica that can only
        take merged weights would serve one run's weights to all, so it is refused by name."""
        try:
            targets = [r.address for r in ctx.rollout.healthy()]
            outcome = await phases.push_to_replicas(ctx, targets)
            merged = [t for t in targets if t not in outcome.failed and not outcome.adapters.get(t)]
            if merged or (targets and len(outcome.failed) == len(targets)):
                raise FailedPrecondition(f"rollout.servers: runs beside others need replicas that serve LoRA "
                                         f"adapters (rollout.engine: torch); {merged or outcome.failed} took "
                                         f"adapter {ctx.adapter!r} as merged weights or not at all")
            ctx.weight_version = outcome.version
        except BaseException:
            self.claims.release(run_id)
            await ctx.close()
            raise

    def _launch(self, record: RunRecord, ctx: RunContext) -> None:
        self.contexts[record.run_id] = ctx
        r = ctx.cfg.run
        for role, scheduler in self.schedulers.items():
            pool = getattr(ctx, role)
            if pool is not None and not isinstance(pool, sharing.ScheduledPool):
                scheduler.join(record.run_id, r.priority, r.max_pool_calls)
                setattr(ctx, role, sharing.ScheduledPool(pool, scheduler, record.run_id))
        self.tasks[record.run_id] = asyncio.create_task(self._drive(record.run_id, ctx))

    async def resume_unfinished(self) -> list[str]:
        """After a coordinator restart: continue every unfinished run from its last completed step."""
        resumed = []
        for record in await self.store.list():
            if record.state not in UNFINISHED or record.run_id in self.tasks:
                continue
            try:
                ctx = await self._reopen(record)
            except TrainerUnavailable as e:
                record.state, record.message = "PAUSED", f"{e}; {e.advice}, then ResumeRun"
                await self.store.put(record)
                continue
            except FailedPrecondition as e:
                # The trainer holds weights the run cannot continue from (recovery.py says which).
                record.state, record.message = "PAUSED", str(e)
                await self.store.put(record)
                continue
            self._launch(record, ctx)
            resumed.append(record.run_id)
        return resumed

    async def _reopen(self, record: RunRecord) -> RunContext:
        """Reconnects a run at the step it and the trainer agree on (coordinator/runapi/recovery.py): its last committed
        step, the step the trainer applied after it, or the last checkpoint's step when the trainer lost its
        weights."""
        cfg = self._with_run_dir(parse_run_config(record.config),
                                 str(Path(record.run_dir).parent) if record.run_dir else "")
        # The services are held to the settings the run trained with so far (a record from before effective
        # configs were recorded: to the keys the run set).
        recorded = yaml.safe_load(record.effective_config) if record.effective_config else None
        ctx = await open_context(record.run_id, cfg, registry=self.registry, position=record.data_position,
                                 recorded=recorded, resume=True, defaults=self.defaults, adapter=record.adapter)
        ctx.step, ctx.weight_version = record.step, record.weight_version
        ctx.ledger = self.store.ledger(record.run_id)
        try:
            if ctx.adapter:     # made anew as the base: its last checkpoint, or step 0
                await recovery.restore_adapter(self.store, record, ctx)
            else:
                # A step the trainer applied but the store missed is recorded as any step is: store,
                # metrics.jsonl, TensorBoard.
                await recovery.settle_trainer(self.store, record, ctx, commit=self._record)
        except BaseException:
            await ctx.close()
            raise
        self.claims.holds(record.run_id, ctx.cfg.trainer.address, ctx.adapter, ctx.cfg.actor.lora is not None)
        if ctx.adapter:
            await self._first_push(ctx, record.run_id)
        # Replicas are asked for their version before they serve; those that differ get the trainer's weights.
        log.info("resuming run %s at step %d (data position %d)", record.run_id, record.step, record.data_position)
        return ctx

    async def _drive(self, run_id: str, ctx: RunContext) -> None:
        try:
            await self._drive_steps(run_id, ctx)
        except asyncio.CancelledError:
            raise
        except TrainerUnavailable as e:
            # The step in flight is dropped (nothing of it was committed); ResumeRun continues once the
            # trainer is back, from the last checkpoint when the restarted trainer lost the weights.
            log.warning("run %s paused: %s", run_id, e)
            self._detach(run_id, ctx)   # before it reads PAUSED, so ResumeRun reconnects
            record = await self.store.get(run_id)
            record.state, record.command = "PAUSED", ""
            record.message = (f"{e}; {e.advice}, then ResumeRun continues from "
                              f"{e.resumes_from(record.step, record.checkpoint_step)}")
            await self.store.put(record)
        except Exception as e:  # noqa: BLE001 - the run fails with its reason, the coordinator keeps serving
            log.exception("run %s failed", run_id)
            await self._release(run_id, ctx)
            record = await self.store.get(run_id)
            record.state, record.message = "FAILED", f"{type(e).__name__}: {e}"
            await self.store.put(record)
        finally:
            await ctx.close()
            sinks = self.sinks.pop(run_id, None)
            if sinks is not None:
                sinks.close()
            self._detach(run_id, ctx)
            await self._notify(run_id)

    async def _release(self, run_id: str, ctx: RunContext) -> None:
        """Frees what the run holds (its adapter on the trainer and the replicas, its pools, its trainer claim, its
        share of the schedulers) before its end state is written: a client that reads COMPLETED, STOPPED or FAILED
        and starts the next run finds them free (else a fifth run's adapter could meet a replica's slots still full).
        A LoRA run on the trainer's own adapter that ends beside other runs also takes it off the replicas."""
        if not ctx.adapter and ctx.cfg.actor.lora is not None and self.claims.others(run_id, ctx.cfg.trainer.address):
            await phases.unload_run_adapter(ctx)
        await ctx.close()
        self._detach(run_id, ctx)

    def _detach(self, run_id: str, ctx: RunContext) -> None:
        # A ResumeRun may already have launched the run's next task: leave that one in place.
        if self.contexts.get(run_id) is ctx:
            self.contexts.pop(run_id)
            self.tasks.pop(run_id, None)
            self.claims.release(run_id)
            for scheduler in self.schedulers.values():
                scheduler.leave(run_id)

    async def _drive_steps(self, run_id: str, ctx: RunContext) -> None:
        cfg = ctx.cfg
        record = await self.store.get(run_id)
        started = time.time()
        refreshed = time.monotonic()
        if record.step == 0 and "heldout_accuracy_before" not in record.last_metrics:
            evals = await ctx.algorithm.evaluate(ctx)
            record.last_metrics = {"heldout_accuracy_before": evals["heldout_accuracy"]}
            await self._record(record, {"step": 0, **evals})
        while ctx.step < cfg.run.num_steps:
            record = await self.store.get(run_id)
            if record.command == "stop":
                await self._release(run_id, ctx)
                record.state, record.command = "STOPPED", ""
                await self.store.put(record)
                return
            if record.command == "pause" or record.state == "PAUSED":
                if record.state != "PAUSED":
                    record.state = "PAUSED"
                    await self.store.put(record)
                    await self._notify(run_id)
                await asyncio.sleep(0.2)
                continue
            if time.monotonic() - refreshed >= cfg.run.refresh_interval_s:
                # Replicas that restarted or joined come back into the pools between steps.
                await phases.refresh_pools(ctx)
                refreshed = time.monotonic()
            with observe.step_span(ctx):
                metrics = await ctx.algorithm.step(ctx)
            if cfg.run.eval_every and ctx.step % cfg.run.eval_every == 0 and ctx.step < cfg.run.num_steps:
                metrics.update(await ctx.algorithm.evaluate(ctx))
            record = await self.store.get(run_id)
            if cfg.run.checkpoint_every and ctx.step % cfg.run.checkpoint_every == 0:
                await recovery.save_checkpoint(ctx, record)
            record.step, record.weight_version, record.data_position = ctx.step, ctx.weight_version, \
                ctx.data.position
            await self._record(record, {"step": ctx.step, **metrics})
            faults.kill_point("after_commit", ctx.step)
        record = await self.store.get(run_id)
        evals = await ctx.algorithm.evaluate(ctx)
        acc = evals["heldout_accuracy"]
        summary = write_summary(ctx, record, acc, time.time() - started, evals)
        await self._release(run_id, ctx)
        record.state = "COMPLETED"
        record.last_metrics = {**record.last_metrics, "heldout_accuracy_after": acc,
                               "heldout_accuracy_before": summary["heldout_accuracy_before"]}
        await self._record(record, {"step": ctx.step, **evals, "final": 1.0}, ctx)

    async def _record(self, record: RunRecord, metrics: dict, ctx: RunContext | None = None) -> None:
        metrics = {k: float(v) for k, v in metrics.items()}
        metrics["timestamp"] = time.time()
        record.last_metrics = {**record.last_metrics, **{k: v for k, v in metrics.items() if math.isfinite(v)}}
        await self.store.commit(record, metrics)
        ctx = ctx or self.contexts.get(record.run_id)
        if ctx is not None:
            reporting.write_jsonl(ctx.run_dir / "metrics.jsonl", metrics)
            self._sinks(ctx).write(int(metrics["step"]), metrics)
            watch = self.no_signal.setdefault(record.run_id, NoSignalWatch(ctx.cfg.run.zero_variance_warn_steps))
            said = watch.update(metrics)
            if said:
                log.warning("run %s: %s", record.run_id, said)
        await self._notify(record.run_id)

    def _sinks(self, ctx: RunContext):
        from coordinator.runapi.sinks import MetricSinks

        sinks = self.sinks.get(ctx.run_id)
        if sinks is None:
            r = ctx.cfg.run
            sinks = self.sinks[ctx.run_id] = MetricSinks(ctx.run_dir, tensorboard=r.tensorboard,
                                                         wandb_project=r.wandb_project, run_name=ctx.run_id)
        return sinks

    async def get(self, run_id: str) -> RunRecord:
        """The run's record; every RPC that names a run comes through here, so an empty run_id is refused once,
        by its field (INVALID_ARGUMENT), not looked up as the run ''."""
        if not run_id:
            raise ValueError("run_id: required (the id StartRun answered; ListRuns lists every run)")
        record = await self.store.get(run_id)
        if record is None:
            raise NotFound(f"run_id: no run {run_id!r}")
        return record

    async def command(self, run_id: str, command: str) -> RunRecord:
        record = await self.get(run_id)
        if record.state not in UNFINISHED:
            raise FailedPrecondition(f"run {run_id!r} is {record.state}; cannot {command}")
        if command == "resume":
            if record.state != "PAUSED" and record.command != "pause":
                raise FailedPrecondition(f"run {run_id!r} is not paused")
            if run_id not in self.tasks:
                # Paused because the trainer went away: reconnect (restoring the checkpoint) before running.
                try:
                    ctx = await self._reopen(record)
                except TrainerUnavailable as e:
                    raise Unavailable(f"run {run_id!r} stays paused: {e}") from None
                record = await self.store.get(run_id)
                record.command, record.state, record.message = "", "RUNNING", ""
                await self.store.put(record)
                self._launch(record, ctx)
                await self._notify(run_id)
                return record
            record.command, record.state = "", "RUNNING"
        elif run_id not in self.tasks and record.state == "PAUSED":
            # Paused with no task (the trainer went away): nothing would read the command.
            if command == "stop":
                record.state, record.command = "STOPPED", ""
        else:
            record.command = command
        await self.store.put(record)
        await self._notify(run_id)
        return record

    async def wait_for_change(self, run_id: str, timeout: float) -> None:
        cond = self._cond(run_id)
        async with cond:
            try:
                await asyncio.wait_for(cond.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    async def metrics(self, run_id: str, from_step: int = 0) -> list[dict]:
        await self.get(run_id)
        return await self.store.metrics(run_id, from_step)

    async def close(self) -> None:
        for task in list(self.tasks.values()):
            task.cancel()
        for task in list(self.tasks.values()):
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        await self.store.close()


def write_summary(ctx: RunContext, record: RunRecord, accuracy_after: float, seconds: float,
                  final_evals: dict | None = None) -> dict:
    history = []
    path = ctx.run_dir / "metrics.jsonl"
    if path.exists():
        history = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    before = next((m["heldout_accuracy"] for m in history if m["step"] == 0 and "heldout_accuracy" in m),
                  float("nan"))
    steps = [m for m in history if "reward_mean" in m]
    phase_totals: dict[str, float] = {}
    for m in steps:
        for k, v in m.items():
            if k.startswith("time/") and k != "time/step":
                phase_totals[k[5:]] = phase_totals.get(k[5:], 0.0) + v
    total = sum(m.get("time/step", 0.0) for m in steps) or 1.0
    summary = {
        "run_id": ctx.run_id, "started_from": record.started_from, "steps": len(steps), "seconds": seconds,
        "heldout_accuracy_before": before, "heldout_accuracy_after": accuracy_after,
        # The same two numbers under the names a report reader looks for first.
        "accuracy_before": before, "accuracy_after": accuracy_after,
        "reward_curve": [m["reward_mean"] for m in steps],
        "phase_time_shares": {k: v / total for k, v in sorted(phase_totals.items())},
    }
    summary.update(ctx.algorithm.summary(history, final_evals or {}))
    (ctx.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
