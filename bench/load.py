"""Load on a training mesh: scripts polling and streaming a run while Generate traffic hits the rollout pool.

Every service runs as its own process on 127.0.0.1 (trainer, reward, three rollout replicas, coordinator).
  baseline  1,000 Generate calls against one replica directly, nothing else running (and the same calls
            round-robin over the three replicas, still idle)
  load      a GRPO run trains while 16 script clients poll GetRun and follow StreamMetrics, and 1,000
            Generate calls are spread round-robin over the three replicas
Latency percentiles (p50/p99) and error counts of each kind of call go to bench/results/load.json.

    OMP_NUM_THREADS=1 python bench/load.py [--calls 1000] [--clients 16] [--out bench/results/load.json]

CPU only; the run trains the arith task's tiny Qwen2 (examples/arith/model).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402
import yaml  # noqa: E402

from coordinator.cli.launcher import Launcher  # noqa: E402
from coordinator.client import Client  # noqa: E402
from meshrl.v1 import rollout_pb2, rollout_pb2_grpc  # noqa: E402

ARITH_MODEL = REPO / "examples" / "arith" / "model"
PROMPTS = [f"{a}+{b}=" for a in range(10) for b in range(10)]


def percentiles(seconds: list[float]) -> dict:
    if not seconds:
        return {"count": 0}
    ordered = sorted(seconds)
    at = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"count": len(ordered), "p50_ms": 1000 * statistics.median(ordered), "p99_ms": 1000 * at(0.99),
            "max_ms": 1000 * ordered[-1], "mean_ms": 1000 * statistics.fmean(ordered)}


def generate_calls(addresses: list[str], num_calls: int, concurrency: int) -> dict:
    """num_calls Generate calls, round-robin over `addresses`, `concurrency` in flight at once."""
    channels = [grpc.insecure_channel(a) for a in addresses]
    stubs = [rollout_pb2_grpc.RolloutStub(c) for c in channels]
    order = itertools.cycle(range(len(stubs)))
    lock = threading.Lock()
    latencies: list[float] = []
    errors: dict[str, int] = {}
    per_replica = [0] * len(stubs)

    def one(i: int) -> None:
        with lock:
            r = next(order)
        request = rollout_pb2.GenerateRequest(
            prompts=[rollout_pb2.Prompt(id=str(i), text=PROMPTS[i % len(PROMPTS)])],
            sampling=rollout_pb2.SamplingParams(n=4, temperature=1.0, max_tokens=6, seed=i + 1))
        t0 = time.perf_counter()
        try:
            reply = stubs[r].Generate(request, timeout=120)
            assert len(reply.responses[0].samples) == 4
            ok = True
        except (grpc.RpcError, AssertionError) as e:
            ok = False
            name = e.code().name if isinstance(e, grpc.RpcError) else "bad_reply"
            with lock:
                errors[name] = errors.get(name, 0) + 1
        with lock:
            if ok:
                latencies.append(time.perf_counter() - t0)
                per_replica[r] += 1

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(num_calls)))
    seconds = time.perf_counter() - start
    for c in channels:
        c.close()
    return {**percentiles(latencies), "calls": num_calls, "errors": sum(errors.values()), "errors_by_code": errors,
            "calls_per_s": num_calls / seconds, "seconds": seconds, "ok_per_replica": per_replica,
            "replicas": len(addresses), "concurrency": concurrency}


class ScriptClients:
    """Clients of the run API, as scripts use it: each polls GetRun and follows StreamMetrics."""

    def __init__(self, address: str, run_id: str, num_clients: int, poll_s: float):
        self.address, self.run_id, self.poll_s = address, run_id, poll_s
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.get_run: list[float] = []
        self.errors: dict[str, int] = {}
        self.records = [0] * num_clients
        self.threads = [threading.Thread(target=self._poll, daemon=True) for _ in range(num_clients)]
        self.threads += [threading.Thread(target=self._stream, args=(i,), daemon=True) for i in range(num_clients)]

    def _error(self, kind: str, e: grpc.RpcError) -> None:
        with self.lock:
            key = f"{kind}:{e.code().name}"
            self.errors[key] = self.errors.get(key, 0) + 1

    def _poll(self) -> None:
        with Client(self.address) as client:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                try:
                    client.get_run(self.run_id)
                    with self.lock:
                        self.get_run.append(time.perf_counter() - t0)
                except grpc.RpcError as e:
                    self._error("GetRun", e)
                self.stop.wait(self.poll_s)

    def _stream(self, i: int) -> None:
        with Client(self.address) as client:
            try:
                for _ in client.stream_metrics(self.run_id):
                    self.records[i] += 1
                    if self.stop.is_set():
                        return
            except grpc.RpcError as e:
                self._error("StreamMetrics", e)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()


def run_config(model: str, run_dir: Path, addresses: dict[str, list[str]], num_steps: int) -> dict:
    return {"model": {"path": model}, "rollout": {"n": 4, "temperature": 1.0, "max_tokens": 6, "seed": 1,
                                                 "servers": addresses["rollout"]},
            "reward": {"servers": addresses["reward"]}, "trainer": {"address": addresses["trainer"][0]},
            "actor": {"lr": 5e-4},
            "data": {"train_files": [str(REPO / "examples/arith/data/train.jsonl")], "rollout_batch_size": 8},
            "run": {"name": "load", "num_steps": num_steps, "run_dir": str(run_dir)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8, help="Generate calls in flight at once")
    parser.add_argument("--poll-s", type=float, default=0.1, help="seconds between a client's GetRun polls")
    parser.add_argument("--model", default=str(ARITH_MODEL))
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "load.json"))
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="meshrl-load-"))
    config_path = work / "mesh.yaml"
    config_path.write_text(yaml.safe_dump({"model": {"path": args.model}}))
    with Launcher(str(config_path), log_dir=work / "logs") as launcher:
        children = [launcher.start("trainer"), launcher.start("reward")]
        children += [launcher.start("rollout", i) for i in range(3)]
        children.append(launcher.start("coordinator"))
        addresses: dict[str, list[str]] = {}
        for c in children:
            addresses.setdefault(c.role, []).append(launcher.wait_ready(c))
        print(f"mesh up: {addresses}", flush=True)

        baseline = generate_calls(addresses["rollout"][:1], args.calls, args.concurrency)
        print(f"baseline (one replica, idle mesh): p50 {baseline['p50_ms']:.1f} ms, "
              f"p99 {baseline['p99_ms']:.1f} ms, {baseline['errors']} errors", flush=True)
        idle_three = generate_calls(addresses["rollout"], args.calls, args.concurrency)

        coordinator = addresses["coordinator"][0]
        with Client(coordinator) as client:
            run_id = client.start_run(yaml.safe_dump(run_config(args.model, work / "runs", addresses, 10_000)))
            with ScriptClients(coordinator, run_id, args.clients, args.poll_s) as scripts:
                time.sleep(2.0)                        # the run is past its first evaluation
                step_before = client.get_run(run_id).step
                loaded = generate_calls(addresses["rollout"], args.calls, args.concurrency)
                status = client.get_run(run_id)
            client.stop_run(run_id)
            final = client.wait(run_id)
        print(f"under load (three replicas, training, {args.clients} script clients): p50 {loaded['p50_ms']:.1f} ms, "
              f"p99 {loaded['p99_ms']:.1f} ms, {loaded['errors']} errors", flush=True)

    result = {
        "benchmark": "load",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "omp_num_threads": os.environ.get("OMP_NUM_THREADS")},
        "request": {"prompts": 1, "n": 4, "max_tokens": 6, "temperature": 1.0},
        "baseline_one_replica_idle": baseline,
        "three_replicas_idle": idle_three,
        "three_replicas_while_training": loaded,
        "script_clients": {"clients": args.clients, "poll_s": args.poll_s,
                           "get_run": percentiles(scripts.get_run), "errors": sum(scripts.errors.values()),
                           "errors_by_kind": scripts.errors,
                           "metric_records_per_stream": {"min": min(scripts.records), "max": max(scripts.records)}},
        "training": {"steps_during_load": status.step - step_before, "final_state": final.state,
                     "steps": final.step},
        "errors_total": baseline["errors"] + idle_three["errors"] + loaded["errors"] + sum(scripts.errors.values()),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
