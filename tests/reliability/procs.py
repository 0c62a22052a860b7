"""Helpers of the fault tests: service processes that can be killed with SIGKILL and restarted on their port."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import yaml

from coordinator.cli.launcher import Child, Launcher, ServiceFailed
from coordinator.client import Client
from coordinator.runapi.service import CoordinatorSettings, start as start_coordinator
from services.common.config import load_config
from tests import ports

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "examples" / "arith" / "data" / "train.jsonl")
HELDOUT = str(REPO / "examples" / "arith" / "data" / "heldout.jsonl")
# What a service prints when it cannot bind its port (services/common/rpc/server.py's bind_failure).
BIND_FAILED = "could not bind 127.0.0.1:"
# Keys whose values differ between two runs of the same seed (clocks, throughput).
TIMING_KEYS = ("time/", "timestamp", "samples_per_s", "tokens_per_s", "seconds", "gb_per_s")


def run_config(model_path: str, run_dir: Path, **sections: dict) -> dict:
    """A small seeded GRPO run: 4 prompts x 4 samples a step, replicas re-checked every 0.2 s."""
    cfg: dict[str, Any] = {
        "model": {"path": model_path},
        "rollout": {"n": 4, "temperature": 1.0, "max_tokens": 6, "seed": 1234},
        "actor": {"lr": 1e-4},
        "reward": {},
        "reference": {},
        "algorithm": {"adv_estimator": "grpo", "logprob_parity_every": 1},
        "data": {"train_files": [TRAIN], "heldout_files": [HELDOUT], "heldout_size": 4, "rollout_batch_size": 4},
        "run": {"num_steps": 4, "run_dir": str(run_dir), "refresh_interval_s": 0.2},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return cfg


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def with_addresses(cfg: dict, addresses: dict[str, list[str]]) -> dict:
    """The run config with the started processes' addresses filled in."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in cfg.items()}
    for role in ("rollout", "reward", "reference"):
        if addresses.get(role):
            out[role] = {**out.get(role, {}), "servers": list(addresses[role])}
    out["trainer"] = {**out.get("trainer", {}), "address": addresses["trainer"][0]}
    return out


class Procs:
    """Service processes of one test. Every process is killed at close(), whatever happened."""

    def __init__(self, config_path: Path, log_dir: Path, overrides: dict[str, str] | None = None):
        self.launcher = Launcher(str(config_path), log_dir=log_dir, overrides=overrides or {})
        self._index = 0

    def start(self, role: str, *, port: int = 0, args: list[str] | None = None, wait: bool = True) -> Child:
        self._index += 1
        child = self.launcher.start(role, self._index, extra_args=["--port", str(port), *(args or [])])
        child.args = list(args or [])          # kept for restart()
        if wait:
            self.wait(child)
        return child

    def start_all(self, specs: list[tuple[str, list[str]]]) -> list[Child]:
        """Starts every (role, args) at once and waits for all: start-up overlaps."""
        children = [self.start(role, args=args, wait=False) for role, args in specs]
        for c in children:
            self.wait(c)
        return children

    def wait(self, child: Child, timeout: float = 240.0) -> str:
        return self.launcher.wait_ready(child, timeout=timeout)

    @staticmethod
    def kill9(child: Child) -> None:
        os.kill(child.proc.pid, signal.SIGKILL)
        child.proc.wait(timeout=30)

    def restart(self, child: Child) -> Child:
        """The same role on the same port (static server lists keep naming it), once it serves."""
        def start(port: int) -> Child:
            new = self.start(child.role, port=port, args=getattr(child, "args", []), wait=False)
            try:
                self.wait(new)
            except ServiceFailed:
                # Only a bind that failed on a port still in use (the old socket may linger a moment after
                # SIGKILL) is tried again; any other failure is the test's.
                if f"{BIND_FAILED}{port}: " in Procs.log(new) and ports.in_use(Procs.log(new)):
                    time.sleep(0.2)
                    raise ports.PortInUse(port) from None
                raise
            return new
        return ports.start_on_a_port(start, port=int(child.address.rsplit(":", 1)[1]), attempts=25)

    @staticmethod
    def log(child: Child) -> str:
        return child.log_path.read_text() if child.log_path.exists() else ""

    def close(self) -> None:
        for c in self.launcher.children:
            if c.proc.poll() is None:
                c.proc.kill()
        for c in self.launcher.children:
            try:
                c.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@contextlib.asynccontextmanager
async def coordinator(redis_url: str):
    """A coordinator on port 0 that keeps its runs under a fresh Redis prefix, and a client of it."""
    settings = load_config(CoordinatorSettings, data={"run": {"redis_url": redis_url,
                                                              "redis_prefix": f"meshrl-rel-{uuid.uuid4().hex[:8]}"}})
    server, port, engine = await start_coordinator(settings, "127.0.0.1:0")
    client = Client(f"127.0.0.1:{port}")
    try:
        yield engine, client
    finally:
        client.close()
        await engine.close()
        await server.stop(0)


def kill_at_each_point(cfg: dict, tmp_path: Path, redis_url: str, monkeypatch, kill_step: int,
                       check: Callable[[str, Any, list[dict], str, list[dict]], None],
                       points: tuple[str, ...] = (), prefix: str = "") -> None:
    """For each point of coordinator/training/faults.py's KILL_POINTS, one run on the same trainer, reward and rollout
    processes: a coordinator killed there at step `kill_step`, then a restarted one (same Redis prefix) that runs
    it to COMPLETED; then check(point, final status, streamed metrics, trainer log, metrics.jsonl records), while
    the processes still run (a failed check stops them all). `points`: those only; `prefix`: the coordinators'
    Redis prefix (default a fresh one)."""
    from coordinator.training.faults import ENV, KILL_POINTS

    path = write_config(tmp_path / "run.yaml", cfg)
    coordinator_args = ["--run.redis_url", redis_url, "--run.redis_prefix",
                        prefix or f"meshrl-once-{uuid.uuid4().hex[:8]}"]
    with Procs(path, tmp_path / "logs") as procs:
        trainer, reward, rollout = procs.start_all([("trainer", []), ("reward", []), ("rollout", [])])
        run_cfg = yaml.safe_dump(with_addresses(cfg, {"trainer": [trainer.address], "reward": [reward.address],
                                                      "rollout": [rollout.address]}))
        for point in points or KILL_POINTS:
            monkeypatch.setenv(ENV, f"{point}:step{kill_step}")
            doomed = procs.start("coordinator", args=coordinator_args)
            monkeypatch.delenv(ENV)
            with Client(doomed.address) as client:
                run_id = client.start_run(run_cfg)
            doomed.proc.wait(timeout=300)
            assert doomed.proc.returncode == -9, Procs.log(doomed)[-2000:]
            restarted = procs.start("coordinator", args=coordinator_args)
            with Client(restarted.address) as client:
                final = client.wait(run_id)
                assert final.state == "COMPLETED", f"{point}: {final.message}"
                records = list(client.stream_metrics(run_id))
            Procs.kill9(restarted)
            jsonl = [json.loads(line) for line in (Path(final.run_dir) / "metrics.jsonl").read_text().splitlines()]
            check(point, final, records, Procs.log(trainer), jsonl)


def ledger_report(redis_url: str, prefix: str, run_id: str, num_steps: int, batch: int) -> dict[str, int]:
    """Exactly-once by the async ledger's settled log (coordinator/runapi/store.py): steps missing or settled twice,
    prompt groups (data positions) trained twice or never, left unsettled, or trained by another step than the one
    whose prompts they are (step s trains the `batch` groups after the s - 1 before it)."""
    from coordinator.runapi.store import RedisStore

    async def settled() -> list[dict]:
        store = RedisStore(redis_url, prefix=prefix)
        try:
            return await store.ledger(run_id).settled()
        finally:
            await store.close()

    lines = asyncio.run(settled())
    steps = [line["step"] for line in lines]
    trained = [p for line in lines for p in line.get("trained", [])]
    return {"steps_missing": len(set(range(1, num_steps + 1)) - set(steps)),
            "steps_twice": len(steps) - len(set(steps)),
            "groups_twice": len(trained) - len(set(trained)),
            "groups_lost": len(set(range(num_steps * batch)) - set(trained)),
            "groups_unsettled": sum(len(line.get("unsettled", [])) for line in lines),
            "groups_misplaced": sum(line.get("trained", []) != list(range((line["step"] - 1) * batch,
                                                                           line["step"] * batch)) for line in lines)}


LEDGER_OK = dict.fromkeys(("steps_missing", "steps_twice", "groups_twice", "groups_lost", "groups_unsettled",
                           "groups_misplaced"), 0)


def comparable(metrics: dict) -> dict:
    """A step's metrics without the ones that measure time."""
    return {k: v for k, v in metrics.items() if not any(t in k for t in TIMING_KEYS)}


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
