"""Weight sync over CUDA IPC between two processes on one GPU, against a same-process device copy.

The "trainer" (this process) holds Qwen2.5-0.5B- or 1.5B-shaped bf16 weights (random, HF names,
tied embedding once) and packs them into flat staging buckets of --bucket-mib (a tensor larger
than a bucket gets its own). The buckets are shared once with a spawned "rollout" process through
torch.multiprocessing (cudaIpcGetMemHandle under the hood); each sync is then: pack (one foreach
copy on the device), stream sync, a pipe message, the rollout's unpack into its own parameters (one
foreach copy), its stream sync and an ack. Timed from the start of the pack to the ack; the first
sync (the rollout opens the IPC handles) is reported apart. Baseline: one foreach device-to-device
copy of every weight into a second set in the same process. Correctness: the rollout's fp64 sum of
every tensor equals the trainer's after the last sync.

    PYTHONPATH=.:protos python bench/weight_sync_ipc.py [--sizes 0.5b,1.5b] [--out bench/results/weight_sync_ipc.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

SHAPES = {
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=1000, tie_word_embeddings=True),
}


def weight_shapes(shape: dict) -> dict[str, tuple[int, ...]]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
    seen, out = set(), {}
    for name, p in model.named_parameters():      # tied weights once, as named_weights does
        if id(p) not in seen:
            seen.add(id(p))
            out[name] = tuple(p.shape)
    return out


def plan_buckets(shapes: dict[str, tuple[int, ...]], bucket_numel: int) -> list[list[tuple[str, int, int]]]:
    """[(name, offset, numel)] per bucket, in order; a tensor larger than a bucket gets its own."""
    buckets, cur, used = [], [], 0
    for name, s in shapes.items():
        n = 1
        for d in s:
            n *= d
        if cur and used + n > bucket_numel:
            buckets.append(cur)
            cur, used = [], 0
        cur.append((name, used, n))
        used += n
    if cur:
        buckets.append(cur)
    return buckets


def views(bufs: list[torch.Tensor], plan, shapes) -> tuple[list[str], list[torch.Tensor]]:
    names, out = [], []
    for buf, items in zip(bufs, plan):
        for name, off, n in items:
            names.append(name)
            out.append(buf[off:off + n].view(shapes[name]))
    return names, out


def rollout_proc(conn, bufs, plan, shapes, device: str) -> None:
    """The receiving replica: its own parameters, filled from the shared buckets on each 'sync'."""
    torch.cuda.set_device(device)
    params = {n: torch.empty(s, dtype=torch.bfloat16, device=device) for n, s in shapes.items()}
    _, src = views(bufs, plan, shapes)
    dst = list(params.values())
    torch.cuda.synchronize()
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg == "sync":
            torch._foreach_copy_(dst, src)
            torch.cuda.current_stream().synchronize()
            conn.send("done")
        elif msg == "checksum":
            conn.send([float(p.double().sum()) for p in dst])
        else:
            return


def bench_size(size: str, *, bucket_mib: int, repeats: int, device: str) -> dict:
    shapes = weight_shapes(SHAPES[size])
    g = torch.Generator(device=device).manual_seed(0)
    weights = {n: torch.randn(s, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)
               for n, s in shapes.items()}
    num_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    plan = plan_buckets(shapes, bucket_mib * 2**20 // 2)
    bufs = [torch.empty(sum(n for _, _, n in items), dtype=torch.bfloat16, device=device) for items in plan]
    _, staging = views(bufs, plan, shapes)
    src = list(weights.values())

    # Baseline: one device-to-device copy of every weight in this process.
    second = [torch.empty_like(t) for t in src]
    base = []
    for i in range(repeats + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch._foreach_copy_(second, src)
        torch.cuda.synchronize()
        if i >= 2:
            base.append(time.perf_counter() - t0)

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=rollout_proc, args=(child, bufs, plan, shapes, device), daemon=True)
    t_spawn = time.perf_counter()
    proc.start()
    assert parent.recv() == "ready"
    startup = time.perf_counter() - t_spawn
    times = []
    for _ in range(repeats + 1):
        for t in src:                      # new weights each round: the trainer just stepped
            t.mul_(1.0001)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch._foreach_copy_(staging, src)
        torch.cuda.current_stream().synchronize()
        parent.send("sync")
        assert parent.recv() == "done"
        times.append(time.perf_counter() - t0)
    parent.send("checksum")
    theirs = parent.recv()
    ours = [float(t.double().sum()) for t in src]
    parent.send("exit")
    proc.join(timeout=30)
    steady = statistics.median(times[1:])
    return {
        "size": size, "num_tensors": len(shapes), "num_bytes": num_bytes, "num_buckets": len(bufs),
        "bucket_mib": bucket_mib, "checksums_match": ours == theirs,
        "ipc_seconds": round(steady, 5), "ipc_gb_per_s": round(num_bytes / steady / 1e9, 1),
        "ipc_first_sync_seconds": round(times[0], 5), "ipc_all_seconds": [round(x, 5) for x in times],
        "rollout_process_start_seconds": round(startup, 2),
        "same_process_copy_seconds": round(statistics.median(base), 5),
        "same_process_copy_gb_per_s": round(num_bytes / statistics.median(base) / 1e9, 1),
        "ipc_vs_same_process_copy": round(steady / statistics.median(base), 2),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0.5b,1.5b")
    parser.add_argument("--bucket-mib", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "weight_sync_ipc.json"))
    args = parser.parse_args(argv)
    rows = []
    for size in args.sizes.split(","):
        row = bench_size(size, bucket_mib=args.bucket_mib, repeats=args.repeats, device=args.device)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "ipc_all_seconds"}), flush=True)
        torch.cuda.empty_cache()
    out = {"benchmark": "weight_sync_ipc", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "dtype": "bfloat16", "notes": "bytes counted once (the model's size); GB = 1e9 bytes", "results": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
