"""Multi-GPU benchmarks of one host -> bench/results/multi_gpu.json.

Parts (--parts, all by default); a part or layout the machine has too few GPUs for is recorded as skipped,
with the reason, so one script serves 1, 2, 4 and 8 GPUs:

  mfu   the trainer's TrainActor on each mesh layout (--layouts), Qwen2.5-1.5B-shaped random weights in bf16
        (trainer_mfu.py's `engine` variant: bf16 params and AdamW state, compiled blocks, fused LM head where
        the layout allows it). Every layout is the real service: `torchrun --nproc_per_node=W -m
        services.trainer`, driven over gRPC by this process with columnar TrainActor requests of 8 sequences
        x 2048 tokens per DP rank, one optimizer step each. MFU = model FLOPs / step time / (W x 989 TFLOP/s),
        FLOPs counted as in trainer_mfu.py. Baseline: the one-GPU layout, measured in the same run
        (`per_gpu_vs_one_gpu` = tokens/s per GPU over the one-GPU layout's). Started as `meshrl up` starts a
        trainer (coordinator.cli.launcher): torchrun for several ranks, a plain process for one.
  sync  bench/weight_sync.py --transport nccl for the 0.5B and 1.5B shapes (trainer on cuda:0, one replica
        on cuda:1), beside a CuPy NCCL broadcast of the same bytes between the same two GPUs in the same run
        (goal: the transport reaches >= 70% of that broadcast's GB/s).
  grpo  a short GRPO run of examples/arith through `meshrl up` with per-role placement (`devices:` per role):
        4+ GPUs: trainer dp=2 on GPUs 0,1, two rollout replicas on GPUs 2 and 3, reference on GPU 0, nccl weight
        sync; 2-3 GPUs: trainer on 0, one replica on 1, nccl; 1 GPU: everything on GPU 0 with ipc.

Each part merges its rows into --out as it finishes (a later call with other parts or layouts keeps them).

    PYTHONPATH=.:protos python bench/multi_gpu.py --out bench/results/multi_gpu.json
    PYTHONPATH=.:protos python bench/multi_gpu.py --parts mfu --layouts 1gpu,dp2,tp2,pp2 --steps 3
    PYTHONPATH=.:protos python bench/multi_gpu.py --parts mfu --device cpu --shape tiny --seq 64 \
        --layouts 1gpu,dp2 --parts mfu,grpo --grpo-steps 3 --out /tmp/multi_gpu_smoke.json   # on CPU (gloo)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "protos"), str(REPO / "bench")]

import torch  # noqa: E402

import trainer_mfu  # noqa: E402  (bench/trainer_mfu.py: shapes, FLOP count, model and batch makers)

# name: (tp, pp, dp)
LAYOUTS = {"1gpu": (1, 1, 1), "dp2": (1, 1, 2), "tp2": (2, 1, 1), "pp2": (1, 2, 1), "dp2-tp2": (2, 1, 2),
           "dp4": (1, 1, 4), "dp2-pp2": (1, 2, 2), "dp2-tp2-pp2": (2, 2, 2), "dp8": (1, 1, 8)}


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def merge(out: Path, part: str, rows: list[dict], key: str) -> None:
    """Rows replace the file's rows of the same part and key; everything else stays."""
    old = json.loads(out.read_text()) if out.exists() else {}
    new_keys = {r[key] for r in rows}
    keep = [r for r in old.get(part, []) if r.get(key) not in new_keys]
    env = {"gpus": gpu_count(), "device": torch.cuda.get_device_name(0) if gpu_count() else "cpu",
           "cpu_count": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    old.update(benchmark="multi_gpu", environments={**old.get("environments", {}), part: env}, **{part: keep + rows})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(old, indent=1) + "\n")


# --------------------------------------------------------------------------------------------------
# mfu


def run_layout(name: str, model: Path, num_params: int, work: Path, *, shape: str, device: str, seq: int,
               per_dp: int, warmup: int, steps: int) -> dict:
    from coordinator.cli.launcher import Launcher
    from meshrl.v1 import common_pb2, trainer_pb2_grpc
    from services.common.rpc.channel import create_channel
    from services.trainer import convert
    from services.trainer.types import ActorLoss

    tp, pp, dp = LAYOUTS[name]
    world = tp * pp * dp
    row = {"layout": name, "tp": tp, "pp": pp, "dp": dp, "gpus": world}
    if device == "cuda" and world > gpu_count():
        return {**row, "skipped": f"needs {world} GPUs, this machine has {gpu_count()}"}
    cfg = trainer_mfu.SHAPES[shape]
    batch = per_dp * dp
    samples = trainer_mfu.make_samples(batch, seq, cfg["vocab_size"])
    request = convert.train_actor_to_pb(samples, ActorLoss(), columnar=True)
    config = work / f"trainer-{name}.json"
    config.write_text(json.dumps({
        "model": {"path": str(model), "dtype": "bfloat16" if device == "cuda" else "float32", "device": device},
        "actor": {"lr": 1e-6, "tp_size": tp, "pp_size": pp, "dp_size": dp, "micro_batch_token_budget": 16384},
        "server": {"max_message_bytes": 256 * 2**20}}))

    async def drive(address: str):
        times, engine_s, losses = [], [], []
        async with create_channel(address, max_message_bytes=256 * 2**20, timeout=1800) as channel:
            stub = trainer_pb2_grpc.TrainerStub(channel)
            info = await stub.GetInfo(common_pb2.GetInfoRequest())
            for i in range(warmup + steps):
                t0 = time.perf_counter()
                reply = await stub.TrainActor(request, timeout=1800)
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
                    engine_s.append(reply.metrics["seconds"])
                losses.append(reply.metrics["loss"])
        return dict(info.details), times, engine_s, losses

    # The way `meshrl up` starts a trainer: torchrun for several ranks, its GPUs as CUDA_VISIBLE_DEVICES.
    gpus = ",".join(str(i) for i in range(world)) if device == "cuda" else ""
    with Launcher(str(config), log_dir=work / f"logs-{name}", num_threads=4 if device == "cuda" else 1) as launcher:
        child = launcher.start("trainer", nproc=world, devices=gpus)
        details, times, engine_s, losses = asyncio.run(drive(launcher.wait_ready(child, timeout=600)))
    flops = trainer_mfu.model_flops_per_step(cfg, num_params, batch, seq)
    step = statistics.median(times)
    row.update(sequences=batch, seq_len=seq, tokens=batch * seq, steps=steps, warmup=warmup,
               seconds=round(step, 4), engine_seconds=round(statistics.median(engine_s), 4),
               all_seconds=[round(t, 4) for t in times], tokens_per_s=round(batch * seq / step),
               tokens_per_s_per_gpu=round(batch * seq / step / world),
               mfu=round(flops / step / (world * trainer_mfu.PEAK_BF16), 4),
               losses=[round(x, 5) for x in losses], devices=details.get("devices"))
    return row


def part_mfu(args, work: Path) -> None:
    model = work / f"qwen2.5-{args.shape}"
    num_params = trainer_mfu.save_model(trainer_mfu.SHAPES[args.shape], model, "cuda" if gpu_count() else "cpu")
    rows = []
    for name in args.layouts.split(","):
        if name not in LAYOUTS:
            raise SystemExit(f"--layouts: unknown layout {name!r}; known: {', '.join(LAYOUTS)}")
        try:
            row = run_layout(name, model, num_params, work, shape=args.shape, device=args.device, seq=args.seq,
                             per_dp=args.per_dp, warmup=args.warmup, steps=args.steps)
        except Exception as e:  # noqa: BLE001  (one failed layout must not lose the others)
            row = {"layout": name, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(row), flush=True)
        rows.append(row)
    base = next((r for r in rows if r["layout"] == "1gpu" and "mfu" in r), None)
    for r in rows:
        if base and "mfu" in r:
            r["per_gpu_vs_one_gpu"] = round(r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"], 3)
    merge(Path(args.out), "trainer_mfu", rows, "layout")


# --------------------------------------------------------------------------------------------------
# sync


def part_sync(args, work: Path) -> None:
    if gpu_count() < 2:
        merge(Path(args.out), "weight_sync_nccl", [{"size": s, "skipped": f"needs 2 GPUs, this machine has "
                                                    f"{gpu_count()}"} for s in args.sync_sizes.split(",")], "size")
        return
    raw = work / "weight_sync_nccl.json"
    subprocess.run([sys.executable, str(REPO / "bench" / "weight_sync.py"), "--transport", "nccl",
                    "--device", "cuda:0", "--replica-device", "cuda:1", "--sizes", args.sync_sizes,
                    "--repeats", "5,3", "--out", str(raw)], check=True, cwd=REPO)
    rows = [r for r in json.loads(raw.read_text())["results"] if r["transport"] == "nccl"]
    for r in rows:
        r["goal_at_least_70_percent_of_broadcast"] = r.get("vs_nccl_broadcast", 0) >= 0.7
    merge(Path(args.out), "weight_sync_nccl", rows, "size")


# --------------------------------------------------------------------------------------------------
# grpo


def placement(gpus: int) -> tuple[str, list[str]]:
    """The run's per-role placement for this many GPUs, as `meshrl up` flags."""
    if gpus == 0:
        return "CPU (a smoke test of the script): one rollout replica, grpc sync", [
            "--rollout.replicas", "1", "--weight_sync.transport", "grpc"]
    if gpus >= 4:
        return "trainer dp=2 on GPUs 0,1; rollout replicas on GPUs 2 and 3; reference on GPU 0; nccl sync", [
            "--trainer.devices", "0,1", "--trainer.nproc_per_node", "2", "--actor.dp_size", "2",
            "--rollout.replicas", "2", "--rollout.devices", "2,3", "--reference.devices", "0",
            "--weight_sync.transport", "nccl"]
    if gpus >= 2:
        return "trainer on GPU 0; one rollout replica on GPU 1; reference on GPU 0; nccl sync", [
            "--trainer.devices", "0", "--rollout.replicas", "1", "--rollout.devices", "1",
            "--reference.devices", "0", "--weight_sync.transport", "nccl"]
    return "every role on GPU 0; ipc sync", ["--trainer.devices", "0", "--rollout.replicas", "1",
                                            "--rollout.devices", "0", "--reference.devices", "0",
                                            "--weight_sync.transport", "ipc"]


def part_grpo(args, work: Path) -> None:
    gpus = gpu_count() if args.device == "cuda" else 0
    if args.device == "cuda" and gpus == 0:
        merge(Path(args.out), "grpo", [{"run": "arith", "skipped": "needs CUDA"}], "run")
        return
    described, flags = placement(gpus)
    run_dir = work / "grpo-runs"
    cmd = [sys.executable, "-m", "coordinator.cli", "up", str(REPO / "examples" / "arith" / "grpo.yaml"),
           "--run-dir", str(run_dir), "--threads", "2", "--model.device", args.device,
           "--run.num_steps", str(args.grpo_steps), "--run.eval_every", "0", *flags]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    (work / "grpo.log").write_text(done.stdout + done.stderr)
    row = {"run": "arith", "placement": described, "flags": flags, "gpus": gpus, "rc": done.returncode,
           "wall_seconds": round(wall, 1)}
    metrics_files = sorted(run_dir.glob("*/metrics.jsonl"), key=lambda p: p.stat().st_mtime)
    if metrics_files:
        steps = [json.loads(line) for line in metrics_files[-1].read_text().splitlines() if line.strip()]
        steps = [m for m in steps if "reward_mean" in m]
        timed = steps[1:] or steps                    # the first step compiles and forms the weight group
        phases = sorted({k for m in timed for k in m if k.startswith("time/")})
        row.update(steps=len(steps), reward_curve=[round(m["reward_mean"], 4) for m in steps],
                   phase_seconds_median={k[5:]: round(statistics.median(m.get(k, 0.0) for m in timed), 4)
                                         for k in phases},
                   first_weight_sync_seconds=round(steps[0].get("time/weight_sync", 0.0), 4) if steps else None)
        summary = metrics_files[-1].parent / "summary.json"
        if summary.exists():
            got = json.loads(summary.read_text())
            row.update(heldout_accuracy_before=got.get("heldout_accuracy_before"),
                       heldout_accuracy_after=got.get("heldout_accuracy_after"))
    if done.returncode:
        row["error_tail"] = (done.stdout + done.stderr)[-2000:]
    print(json.dumps(row), flush=True)
    merge(Path(args.out), "grpo", [row], "run")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="mfu,sync,grpo")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--shape", choices=["1.5b", "0.5b", "tiny"], default="1.5b", help="mfu: the model shape")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: the mfu layouts as gloo processes and the GRPO run on CPU (a smoke test of the script)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--per-dp", type=int, default=8, help="sequences per DP rank and step")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--sync-sizes", default="0.5b,1.5b")
    parser.add_argument("--grpo-steps", type=int, default=10)
    parser.add_argument("--work-dir", default="/tmp/meshrl-multi-gpu")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "multi_gpu.json"))
    args = parser.parse_args(argv)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    parts = {"mfu": part_mfu, "sync": part_sync, "grpo": part_grpo}
    for part in args.parts.split(","):
        if part not in parts:
            raise SystemExit(f"--parts: unknown part {part!r}; known: {', '.join(parts)}")
        parts[part](args, work)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
