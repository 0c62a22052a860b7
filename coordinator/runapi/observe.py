"""The coordinator's part of observability (docs/observability.md): each step's root span, and Prometheus metrics
of its runs (step, state, weight version, reward, accuracy, phase seconds), each labelled `run_id` so a dashboard
shows one run of many on the mesh (docs/many_runs.md), and of their replica pools (health, retried calls)."""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

import services.common.rpc.tracing as tracing
from services.common.rpc.metrics import LATENCY_BUCKETS

STATES = ("RUNNING", "PAUSED", "COMPLETED", "FAILED", "STOPPED")

# Step metrics carry the run: concurrent runs share one coordinator (docs/many_runs.md).
STEP_PHASE = Histogram("meshrl_coordinator_phase_seconds", "Wall seconds of each phase of a step (time/<phase>)",
                       ["run_id", "phase"], buckets=LATENCY_BUCKETS)
STEP_SECONDS = Histogram("meshrl_coordinator_step_seconds", "Wall seconds of a whole step", ["run_id"],
                         buckets=LATENCY_BUCKETS)
SAMPLES = Counter("meshrl_coordinator_samples", "Samples trained on", ["run_id"])
# Step metrics whose latest value per run is a gauge at scrape time (RunCollector._last).
LAST_METRICS = ("reward_mean", "accuracy", "heldout_accuracy")


def step_span(ctx):
    """The root span of the step about to run (its trace in <run_dir>/traces.jsonl), or nothing (run.traces off)."""
    if not ctx.cfg.run.traces:
        return nullcontext()
    return tracing.step_span(f"step {ctx.step + 1}", ctx.run_dir / "traces.jsonl", **{
        "meshrl.run_id": ctx.run_id, "meshrl.step": ctx.step + 1})


def record_step(run_id: str, metrics: dict) -> None:
    """A committed step's timings into the histograms, under its run."""
    if "reward_mean" not in metrics and "time/step" not in metrics:
        return
    for key, value in metrics.items():
        if key.startswith("time/") and key != "time/step" and math.isfinite(value):
            STEP_PHASE.labels(run_id, key[5:]).observe(value)
    if math.isfinite(metrics.get("time/step", math.nan)):
        STEP_SECONDS.labels(run_id).observe(metrics["time/step"])
    SAMPLES.labels(run_id).inc(metrics.get("num_samples", 0.0))


class ObservedStore:
    """A run store that keeps the last state, step and weight version of each run it saw for the scrape (the
    store itself may be Redis, which a scrape's thread cannot await)."""

    def __init__(self, store):
        self._store = store
        self.runs: dict[str, tuple[str, int, int]] = {}
        self.last: dict[str, dict[str, float]] = {}      # run_id -> its latest reward/accuracy (LAST_METRICS)

    def __getattr__(self, name):
        return getattr(self._store, name)

    async def put(self, record) -> None:
        await self._store.put(record)
        self.runs[record.run_id] = (record.state, record.step, record.weight_version)

    async def commit(self, record, metrics: dict) -> None:
        await self._store.commit(record, metrics)
        self.runs[record.run_id] = (record.state, record.step, record.weight_version)
        last = self.last.setdefault(record.run_id, {})
        last.update({k: v for k, v in metrics.items() if k in LAST_METRICS and math.isfinite(v)})
        record_step(record.run_id, metrics)


class RunCollector:
    """Scrape-time gauges of the manager's runs and pools."""

    def __init__(self, manager, store: ObservedStore):
        self.manager, self.store = manager, store

    def collect(self):
        step = GaugeMetricFamily("meshrl_coordinator_step", "Last completed step of each run", labels=["run_id"])
        version = GaugeMetricFamily("meshrl_coordinator_weight_version", "Weight version of each run",
                                    labels=["run_id"])
        state = GaugeMetricFamily("meshrl_coordinator_run_state", "1 for each run's current state",
                                  labels=["run_id", "state"])
        for run_id, (s, n, v) in list(self.store.runs.items()):
            step.add_metric([run_id], n)
            version.add_metric([run_id], v)
            for name in STATES:
                state.add_metric([run_id, name], 1.0 if s == name else 0.0)
        yield from (step, version, state)
        yield from self._last()
        yield from self._pools()

    def _last(self):
        families = {
            "reward_mean": GaugeMetricFamily("meshrl_coordinator_reward", "Mean reward of each run's last step",
                                             labels=["run_id"]),
            "accuracy": GaugeMetricFamily("meshrl_coordinator_accuracy", "Accuracy of each run's last step",
                                          labels=["run_id"]),
            "heldout_accuracy": GaugeMetricFamily("meshrl_coordinator_heldout_accuracy",
                                                  "Each run's last held-out accuracy", labels=["run_id"])}
        for run_id, last in list(self.store.last.items()):
            for key, value in last.items():
                families[key].add_metric([run_id], value)
        yield from families.values()

    def _pools(self):
        replicas = GaugeMetricFamily("meshrl_coordinator_replicas", "Replicas in each run's pools, by health",
                                     labels=["run_id", "pool", "health"])
        lag = GaugeMetricFamily("meshrl_coordinator_replica_weight_lag",
                                "Weight versions a replica is behind its run (-1: not yet asked)",
                                labels=["run_id", "pool", "replica"])
        retried = CounterMetricFamily("meshrl_coordinator_replica_failures",
                                      "Calls that failed on a replica and were retried on another",
                                      labels=["run_id", "pool", "replica"])
        for run_id, ctx in list(self.manager.contexts.items()):
            for pool in (ctx.rollout, ctx.reward, ctx.reference):
                if pool is None:
                    continue
                reps = list(pool.replicas.values())
                healthy = sum(bool(r.healthy) for r in reps)
                replicas.add_metric([run_id, pool.role, "healthy"], healthy)
                replicas.add_metric([run_id, pool.role, "unhealthy"], len(reps) - healthy)
                for r in reps:
                    retried.add_metric([run_id, pool.role, r.address], getattr(r, "failures", 0))
                    if pool.role == "rollout":
                        v = getattr(r, "weight_version", -1)
                        lag.add_metric([run_id, pool.role, r.address], ctx.weight_version - v if v >= 0 else -1)
        yield from (replicas, lag, retried)


_collector: RunCollector | None = None


def observe_manager(manager) -> None:
    """Scrapes of this process report the manager's runs (one manager per process; a later one replaces it)."""
    global _collector
    if _collector is not None:
        REGISTRY.unregister(_collector)
    _collector = RunCollector(manager, manager.store)
    REGISTRY.register(_collector)
