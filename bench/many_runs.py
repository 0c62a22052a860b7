"""Several LoRA runs on one mesh at once against the same runs one after another, on the same mesh, in one process
(issue #45's measure): aggregate samples/s of K concurrent runs over that of K sequential runs.

One in-process mesh of the arith LoRA recipe (trainer, reward, rollout replicas: services/local.py) serves every
phase; a RunManager drives the runs as the coordinator does. Phases alternate (sequential, concurrent, concurrent,
sequential) so a drift of the machine falls on both; each phase's runs are K copies of the recipe with their own
learning rates. The JSON holds every phase's wall time and samples, and the ratio of the medians.

    OMP_NUM_THREADS=1 .venv/bin/python bench/many_runs.py --shared     # -> bench/results/many_runs_cpu.json

On a GPU (`--device cuda`), the same recipe over a random-weight Qwen2.5-shaped model folder
(examples/gpu/make_model.py --shape qwen2.5-0.5b), bfloat16, one rollout replica with the CUDA-graph decode and
an adapter slot per run, and longer answers (`--max-tokens`), 4 runs:

    python bench/many_runs.py --device cuda --runs 4 --out $OUT/many_runs_gpu.json   # bench/gpu_session.sh manyruns
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "protos")]

from bench.provenance import stamp  # noqa: E402
from coordinator.runapi.runs import RunManager  # noqa: E402
from coordinator.runapi.store import MemoryStore  # noqa: E402
from services.local import start_local_mesh  # noqa: E402

DONE = {"COMPLETED", "FAILED", "STOPPED"}


def recipe(run_dir: Path, args) -> dict:
    data = yaml.safe_load((REPO / "examples/arith/grpo_lora.yaml").read_text())
    data["rollout"]["replicas"] = args.replicas
    data["run"].update(num_steps=args.steps, eval_every=0, run_dir=str(run_dir), checkpoint_every=0)
    if args.device != "cpu":
        data["model"] = {"path": str(args.model_path), "device": args.device, "dtype": "bfloat16"}
        data["rollout"].update(max_tokens=args.max_tokens, max_loras=max(4, args.runs), kv_cache=args.kv_cache)
        data["data"]["rollout_batch_size"] = args.batch
        # A trainer serving several runs' adapters runs eager (actor.compile: auto goes eager at the second run's
        # adapter, adapter_set.check_new): both phases run eager from the start, so the ratio compares like with like.
        data.setdefault("actor", {})["compile"] = False
    return data


def device_name(device: str) -> str:
    if device == "cpu":
        return "cpu"
    import torch
    return torch.cuda.get_device_name(torch.device(device))


def run_yaml(config: dict, name: str, lr: float) -> str:
    return yaml.safe_dump({**config, "run": {**config["run"], "name": name}, "actor": {**config["actor"], "lr": lr}})


def step_times(run_dir: str) -> dict:
    """The mean of each time/* metric over the run's steps (metrics.jsonl): where a step's seconds went."""
    from coordinator.client import metrics_file

    try:
        rows = metrics_file(run_dir)
    except OSError:
        return {}
    keys = sorted({k for r in rows for k in r if k.startswith("time/")})
    return {k: round(statistics.mean(r[k] for r in rows if k in r), 4) for k in keys}


async def finished(manager: RunManager, run_id: str) -> dict:
    while True:
        rec = await manager.get(run_id)
        if rec.state in DONE:
            return {"run_id": run_id, "state": rec.state, "steps": rec.step, "message": rec.message,
                    "time_mean": step_times(rec.run_dir)}
        await asyncio.sleep(0.1)


async def phase(manager: RunManager, config: dict, runs: int, concurrent: bool, tag: str) -> dict:
    """K runs, all at once or one after another; wall time from the first StartRun to the last run's end."""
    lrs = [1e-3, 3e-4, 5e-4, 2e-3][:runs]
    t0 = time.perf_counter()
    ends = []
    if concurrent:
        ids = [await manager.start_run(run_yaml(config, f"{tag}-{i}", lr)) for i, lr in enumerate(lrs)]
        ends = await asyncio.gather(*(finished(manager, r) for r in ids))
    else:
        for i, lr in enumerate(lrs):
            ends.append(await finished(manager, await manager.start_run(run_yaml(config, f"{tag}-{i}", lr))))
    seconds = time.perf_counter() - t0
    per_step = config["data"]["rollout_batch_size"] * config["rollout"]["n"]
    samples = sum(e["steps"] for e in ends) * per_step
    assert all(e["state"] == "COMPLETED" for e in ends), ends
    keys = sorted({k for e in ends for k in e["time_mean"]})
    times = {k: round(statistics.mean(e["time_mean"][k] for e in ends if k in e["time_mean"]), 4) for k in keys}
    return {"mode": "concurrent" if concurrent else "sequential", "seconds": round(seconds, 2), "samples": samples,
            "samples_per_s": round(samples / seconds, 2), "step_time_means": times, "runs": ends}


async def main_async(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        config = recipe(Path(tmp) / "runs", args)
        mesh = await start_local_mesh(config, num_rollout=args.replicas, num_reference=0)
        manager = RunManager(MemoryStore())
        try:
            if args.warmup:
                # One untimed step of K runs at once first: the compiles, CUDA-graph captures and adapter slots a
                # cold mesh makes on its first steps would otherwise fall on whichever phase runs first.
                warm = {**mesh.config, "run": {**mesh.config["run"], "num_steps": 1}}
                print(json.dumps({"warmup_s": (await phase(manager, warm, args.runs, True, "warm"))["seconds"]}),
                      flush=True)
            phases = []
            order = (False, True, True, False) if args.rounds == 2 else (True, False)
            for i, concurrent in enumerate(order):
                phases.append(await phase(manager, mesh.config, args.runs, concurrent, f"p{i}"))
                print(json.dumps({k: v for k, v in phases[-1].items() if k != "runs"}), flush=True)
        finally:
            await manager.close()
            await mesh.stop()
    rate = {m: statistics.median(p["samples_per_s"] for p in phases if p["mode"] == m)
            for m in ("sequential", "concurrent")}
    return {"bench": args.stem, "recipe": "examples/arith/grpo_lora.yaml", "runs": args.runs,
            "steps_per_run": args.steps, "rollout_replicas": args.replicas, "device": device_name(args.device),
            "model": config["model"], "max_tokens": config["rollout"]["max_tokens"],
            "kv_cache": config["rollout"].get("kv_cache", "auto"),
            "actor_compile": config.get("actor", {}).get("compile", "auto"),
            "samples_per_step": config["data"]["rollout_batch_size"] * config["rollout"]["n"],
            "rounds": args.rounds, "warmup": args.warmup, "phases": phases, "median_samples_per_s": rate,
            "ratio_concurrent_over_sequential": round(rate["concurrent"] / rate["sequential"], 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: the model folder of --model-path in bfloat16")
    ap.add_argument("--runs", type=int, default=None, help="runs per phase (default 2 on cpu, 4 on cuda)")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 8 on cpu, 4 on cuda)")
    ap.add_argument("--rounds", type=int, default=2, choices=(1, 2), help="1: concurrent then sequential (the concurrent phase pays the warm-up); 2: ABBA")
    ap.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="one untimed step of the runs at once before the timed phases (default on)")
    ap.add_argument("--replicas", type=int, default=None, help="rollout replicas (default 2 on cpu, 1 on cuda)")
    ap.add_argument("--model-path", type=Path, default=REPO / "examples/gpu/models/qwen2.5-0.5b",
                    help="cuda: a Hugging Face folder (examples/gpu/make_model.py builds the default)")
    ap.add_argument("--max-tokens", type=int, default=128, help="cuda: rollout.max_tokens")
    ap.add_argument("--batch", type=int, default=16, help="cuda: prompts per step (data.rollout_batch_size), n = 8")
    ap.add_argument("--kv-cache", default="auto", help="cuda: rollout.kv_cache (auto, paged, none)")
    ap.add_argument("--shared", action="store_true", help="the machine runs other jobs too (recorded)")
    ap.add_argument("--out", default=None, help="default bench/results/many_runs_<cpu|gpu>.json")
    args = ap.parse_args(argv)
    cpu = args.device == "cpu"
    args.runs = args.runs or (2 if cpu else 4)
    args.steps = args.steps or (8 if cpu else 4)
    args.replicas = args.replicas or (2 if cpu else 1)
    args.stem = "many_runs_cpu" if cpu else "many_runs_gpu"
    args.out = args.out or str(REPO / f"bench/results/{args.stem}.json")
    result = stamp(args.stem, asyncio.run(main_async(args)), shared_machine=args.shared)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"concurrent / sequential samples/s: x{result['ratio_concurrent_over_sequential']}  -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
