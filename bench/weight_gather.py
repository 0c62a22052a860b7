"""The trainer side of a weight push on an FSDP mesh: every rank calling full_tensor() on every weight and
copying the whole model to the host (before) vs the bucketed gather to the sending rank
(services/trainer/weights/gather.py, now). Per variant: seconds (median), and what a rank that does not send holds at
its peak: device bytes over the sharded model, and host bytes of weight copies.

    torchrun --nproc_per_node=2 bench/weight_gather.py --size tiny            # CPU (gloo): bench/results/weight_gather.json
    torchrun --nproc_per_node=8 bench/weight_gather.py --size 1.5b            # GPUs (NCCL): weight_gather_gpu.json

The model is a random Qwen2 of the shape (bench/trainer_mfu.py's SHAPES), fp32 master weights sharded by FSDP2
over every rank, pushed in bf16 (the replicas' dtype).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "protos"), str(REPO / "bench")]

from provenance import stamp  # noqa: E402
from trainer_mfu import SHAPES  # noqa: E402

from services.common.tensors.weights import named_weights  # noqa: E402
from services.trainer.weights.gather import stage_gatherers  # noqa: E402
from services.trainer.parallel.parallelize import apply_fsdp  # noqa: E402


def build(size: str, device: torch.device):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPES[size]))
    mesh = init_device_mesh(device.type, (1, dist.get_world_size(), 1), mesh_dim_names=("pp", "dp", "tp"))
    apply_fsdp(model, mesh["dp"], param_dtype="float32", compute_dtype="bfloat16")
    return model, mesh


def full_everywhere(weights: dict) -> dict:
    """What every rank did before: the full value of every weight, copied to the host in the sync dtype."""
    return {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().to("cpu", dtype=torch.bfloat16,
                                                                                  copy=True)
            for n, t in weights.items()}


def measure(fn, device: torch.device, repeats: int) -> dict:
    seconds, device_peak, host_bytes = [], 0, 0
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
            device_peak = max(device_peak, torch.cuda.max_memory_allocated() - base)
        dist.barrier()
        seconds.append(time.perf_counter() - t0)
        host_bytes = sum(t.numel() * t.element_size() for t in (out or {}).values())
        del out
    return {"seconds": statistics.median(seconds), "device_peak_bytes": device_peak, "host_weight_bytes": host_bytes}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="tiny", choices=list(SHAPES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mib", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    model, mesh = build(args.size, device)
    weights = named_weights(model)
    gatherer = stage_gatherers(mesh)
    variants = {
        "full_tensor_every_rank": lambda: full_everywhere(weights),
        "bucketed_gather_to_sender": lambda: gatherer.gather(weights, dtype=torch.bfloat16, where="cpu",
                                                             bucket_bytes=args.bucket_mib << 20),
    }
    results = {name: measure(fn, device, args.repeats) for name, fn in variants.items()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, results)
    if dist.get_rank() == 0:
        num_params = sum(t.numel() for t in weights.values())
        out = {"benchmark": "weight_gather", "size": args.size, "num_params": num_params,
               "world_size": dist.get_world_size(), "device": torch.cuda.get_device_name() if cuda else "cpu",
               "sync_bytes": num_params * 2, "bucket_bytes": args.bucket_mib << 20,
               # rank 0 sends; rank 1 is a rank that does not
               "sender": every[0], "non_sender": every[1] if len(every) > 1 else None}
        stem = "weight_gather_gpu" if cuda else "weight_gather"
        path = Path(args.out or REPO / "bench" / "results" / f"{stem}.json")
        path.write_text(json.dumps(stamp(stem, out), indent=1) + "\n")
        print(json.dumps(out, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
