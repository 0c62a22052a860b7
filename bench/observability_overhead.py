"""What metrics and tracing cost (issue 25): the CPU e2e GRPO step with observability on vs off, in one run.

    OMP_NUM_THREADS=1 nice .venv/bin/python bench/observability_overhead.py [--rounds 8] [--steps 3] [--shared]

Every service runs in this process on port 0 (services/local.py: trainer, reference, reward, 2 rollouts) with a
Prometheus endpoint up. Rounds alternate on/off (on = every server's observing interceptor counts and times each
call and the step is one trace written to traces.jsonl, the services' spans returned in metadata; off = calls go
through no interceptor of ours and no step is traced), so load on a shared machine hits both alike; a full garbage collection runs (untimed) before each step. Besides the
step, the per-call cost is measured on a small reward Score call, interleaved the same way. Writes
bench/results/observability_cpu.json.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.provenance import stamp  # noqa: E402
from coordinator.recipe.config import RunConfig  # noqa: E402
from coordinator.runapi import observe  # noqa: E402
from coordinator.training import loop  # noqa: E402
from coordinator.training.algorithms import open_context  # noqa: E402
from meshrl.v1 import reward_pb2  # noqa: E402
from services.common.rpc import metrics  # noqa: E402
from services.common.config import load_config  # noqa: E402
from services.local import start_local_mesh  # noqa: E402

OUT = REPO / "bench" / "results" / "observability_cpu.json"


def config(run_dir: str) -> dict:
    return {
        "model": {"path": "examples/arith/model", "dtype": "float32"},
        "rollout": {"n": 8, "temperature": 1.0, "max_tokens": 6, "seed": 1},
        "reward": {"components": [{"name": "exact_match", "weight": 1.0}]},
        "algorithm": {"adv_estimator": "grpo", "use_kl_loss": True, "kl_loss_coef": 0.001},
        "data": {"train_files": ["examples/arith/data/train.jsonl"], "rollout_batch_size": 16},
        "run": {"num_steps": 10_000, "run_dir": run_dir, "save_samples": False, "tensorboard": False},
        "server": {"metrics_port": 0},
    }


async def steps(ctx, n: int, on: bool, cpu: list | None = None) -> list[float]:
    """Wall seconds of n steps; their CPU seconds (this process: every service) go to `cpu`."""
    metrics.OBSERVE = on
    ctx.cfg.run.traces = on
    out = []
    for _ in range(n):
        # A full collection between steps, untimed: otherwise a gen-2 pass over the models' heap (~10 ms) lands in
        # whichever mode's step happens to cross the threshold, which is noise larger than the effect measured.
        gc.collect()
        t0, c0 = time.perf_counter(), time.process_time()
        with observe.step_span(ctx):
            await loop.rl_step(ctx)
        out.append(time.perf_counter() - t0)
        if cpu is not None:
            cpu.append(time.process_time() - c0)
    return out


async def calls(stub, n: int, mode: str, path: Path) -> float:
    """Seconds per small Score call: mode off (no interceptor), metrics (counted, untraced) or traced (counted,
    and inside a traced step, so each call is a client and a server span returned in metadata)."""
    from contextlib import nullcontext

    from services.common.rpc import tracing

    metrics.OBSERVE = mode != "off"
    req = reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(id="a", prompt="1+1=", response="2", ground_truth="2")])
    traced = tracing.step_span("calls", path, **{"meshrl.step": -1}) if mode == "traced" else nullcontext()
    t0 = time.perf_counter()
    with traced:
        for _ in range(n):
            await stub.Score(req)
    return (time.perf_counter() - t0) / n


def summary(on: list[float], off: list[float]) -> dict:
    med_on, med_off = statistics.median(on), statistics.median(off)
    return {"on_median_s": med_on, "off_median_s": med_off, "on_mean_s": statistics.fmean(on),
            "off_mean_s": statistics.fmean(off), "overhead_median_pct": 100 * (med_on / med_off - 1),
            "overhead_mean_pct": 100 * (statistics.fmean(on) / statistics.fmean(off) - 1), "n": len(on)}


async def main(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        mesh = await start_local_mesh(config(tmp), num_rollout=2)
        try:
            ctx = await open_context("overhead", load_config(RunConfig, data=mesh.config))
            await steps(ctx, 2, True)                                   # warm-up: both paths
            await steps(ctx, 2, False)
            step_on, step_off, paired = [], [], []
            cpu = {True: [], False: []}
            for r in range(args.rounds):
                got = {}
                for on in ((True, False) if r % 2 == 0 else (False, True)):
                    got[on] = await steps(ctx, args.steps, on, cpu[on])
                    (step_on if on else step_off).extend(got[on])
                # each round's on/off ratio: load that drifts between rounds cancels out
                paired.append(statistics.median(got[True]) / statistics.median(got[False]) - 1)
            stub = ctx.reward.healthy()[0].stub
            per_call: dict[str, list[float]] = {"off": [], "metrics": [], "traced": []}
            for r in range(args.rounds):
                modes = list(per_call)
                for mode in modes[r % 3:] + modes[:r % 3]:
                    per_call[mode].append(await calls(stub, args.calls, mode, Path(tmp) / "c.jsonl"))
            traces = (ctx.run_dir / "traces.jsonl").read_text().splitlines()
            await ctx.close()
        finally:
            metrics.OBSERVE = True
            await mesh.stop()
    step = {**summary(step_on, step_off), "paired_round_overhead_median_pct": 100 * statistics.median(paired)}
    # CPU seconds of the process (all services run in it) move far less with other jobs' load than wall seconds.
    step_cpu = summary(cpu[True], cpu[False])
    records = [json.loads(line) for line in traces]
    rpcs_per_step = sum(r["kind"] == "client" for r in records) / max(1, sum(r["parent_id"] is None for r in records))
    off = statistics.median(per_call["off"])
    return {
        "what": "CPU e2e GRPO step (arith model, 16 prompts x 8 samples, 2 rollout replicas, all services in one "
                "process) with metrics + tracing on vs off, interleaved rounds in one run; plus a small reward "
                "Score call off / metrics only / metrics + traced",
        "rounds": args.rounds, "steps_per_round": args.steps, "calls_per_round": args.calls,
        "step": step, "step_cpu": step_cpu,
        "call_median_s": {m: statistics.median(v) for m, v in per_call.items()},
        "call_overhead_us": {m: 1e6 * (statistics.median(v) - off) for m, v in per_call.items() if m != "off"},
        "spans_per_step": len(records) / max(1, sum(r["parent_id"] is None for r in records)),
        "rpcs_per_step": rpcs_per_step,
        # The low-noise estimate: what observing adds to each call, times the calls of a step, over the step.
        "modelled_step_overhead_pct": 100 * rpcs_per_step * (statistics.median(per_call["traced"]) - off)
        / step["off_median_s"],
        "goal_pct": 2.0,
        "meets_goal": step_cpu["overhead_median_pct"] < 2.0,
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--shared", action="store_true", help="the machine runs other jobs (recorded in the JSON)")
    args = p.parse_args()
    result = stamp("observability_cpu", asyncio.run(main(args)), shared_machine=args.shared)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("step", "step_cpu", "call_median_s", "call_overhead_us", "spans_per_step",
                                             "rpcs_per_step", "modelled_step_overhead_pct", "meets_goal")}, indent=2))
