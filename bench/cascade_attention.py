"""The shared-prefix decode attention (services/rollout/engine_torch/paged/cascade.py) beside the per-row paged kernel
(paged/attention.py), one layer's attention call at a GRPO decode step's shape: rows in groups of n forked from one
prompt (their prompt's blocks shared), each with its own generated tokens after it; Qwen2.5-0.5B's heads (14 query,
2 kv, head_dim 64), bf16, 16-token blocks. Also n=1 (no two rows share a block): the shared path's cost without
groups. Each call is captured in a CUDA graph (as the decode step runs it) and timed by CUDA events over --repeats
replays; the group kernel's tile, warps, stages and prefix partitions are swept (--sweep); max difference between
the outputs.

    PYTHONPATH=.:protos python bench/cascade_attention.py --out /tmp/cascade_attention_gpu.json
    TRITON_INTERPRET=1 PYTHONPATH=.:protos python bench/cascade_attention.py --device cpu --rows 16 --prefix 64 \
        --suffix 32 --repeats 1 --out /tmp/c.json                                   # smoke test of the script
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from services.rollout.engine_torch.paged.attention import paged_decode_attention
from services.rollout.engine_torch.paged.cascade import (max_groups, paged_decode_attention_shared, rows_per_group,
                                                         share_groups)


def build(rows: int, n: int, prefix: int, suffix: int, heads: int, kv: int, hd: int, bs: int, device: str):
    """Tables (each group's prompt blocks shared, then each row's own), contexts, pool and queries."""
    g = torch.Generator().manual_seed(0)
    pblocks, width = prefix // bs, -(-(prefix + suffix) // bs)
    own = width - pblocks
    tables, nxt = [], 0
    for _ in range(rows // n):
        shared = list(range(nxt, nxt + pblocks))
        nxt += pblocks
        for _ in range(n):
            tables.append(shared + list(range(nxt, nxt + own)))
            nxt += own
    tables = torch.tensor(tables)
    # Each row's generated length varies around `suffix` (a GRPO step's rows end at different lengths).
    ctx = prefix + torch.randint(suffix // 2, suffix + 1, (rows,), generator=g)
    k, v = (torch.randn(nxt * bs, kv, hd, generator=g, dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(rows, heads, hd, generator=g, dtype=torch.bfloat16)
    found = share_groups(tables, ctx - 1, bs, rows_per_group(heads, kv), max_groups(rows))
    lo, groups = found if found is not None else (torch.zeros(rows, dtype=torch.long),
                                                  torch.full((max_groups(rows), rows_per_group(heads, kv)), -1))
    to = lambda *xs: [x.to(device) for x in xs]  # noqa: E731
    return (*to(q, k, v, tables, ctx, lo, groups), int((lo > 0).sum()))


def timed(fn, repeats: int) -> float:
    """Milliseconds a call: replays of one CUDA graph of fn (as the decode step runs it: no launch overhead), timed by
    CUDA events; on the CPU (Triton's interpreter, a smoke test) wall time of plain calls."""
    fn()
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t0) * 1e3 / repeats
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def case(args, n: int) -> dict:
    q, k, v, tables, ctx, lo, groups, grouped = build(args.rows, n, args.prefix, args.suffix, 14, 2, 64, args.bs,
                                                      args.device)
    scale = 64 ** -0.5
    plain = lambda: paged_decode_attention(q, k, v, tables, ctx, args.bs, scale)  # noqa: E731
    want = plain().float()
    out = {"rows": args.rows, "n": n, "grouped_rows": grouped, "plain_ms": round(timed(plain, args.repeats), 4)}
    kv_bytes = 2 * 2 * 64 * 2                                       # K and V, 2 kv heads, head_dim 64, bf16
    out["plain_kv_gb_per_s"] = round(float(ctx.sum()) * kv_bytes / out["plain_ms"] / 1e6, 1)
    out["shared"] = {}
    for config in args.sweep.split(","):                            # tile:warps:stages:prefix partitions (0: auto)
        tile, warps, stages, parts = map(int, config.split(":"))
        kw = dict(group_tile=tile, group_warps=warps, group_stages=stages, prefix_parts=parts or None)
        shared = lambda: paged_decode_attention_shared(q, k, v, tables, ctx, lo, groups, args.bs, scale, **kw)  # noqa: E731
        ms = timed(shared, args.repeats)
        diff = (shared().float() - want).abs().max().item()
        out["shared"][config] = {"ms": round(ms, 4), "vs_plain": round(out["plain_ms"] / ms, 3),
                                 "max_abs_diff": round(diff, 5)}
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--ns", default="8,1", help="rows per prompt, one case each")
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--suffix", type=int, default=256)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--sweep", default="64:4:2:0,128:4:3:0,128:4:2:0,64:4:3:0,32:4:2:0,64:8:2:0,64:4:2:2,64:4:2:8",
                    help="the group kernel's tile:warps:stages:prefix partitions (0: auto), one timing each")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    res = {"benchmark": "cascade_attention",
           "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu (Triton's interpreter)", "torch": torch.__version__,
           "shape": "qwen2.5-0.5b attention (14 q heads, 2 kv, head_dim 64), bf16", "prefix": args.prefix,
           "suffix": args.suffix, "block_size": args.bs,
           "cases": [case(args, int(n)) for n in args.ns.split(",")]}
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
