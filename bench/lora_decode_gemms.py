"""The LoRA engine's extra GEMM work in one decode step (issue 43's decode gap), kernel by kernel at the Qwen2.5-1.5B
shape: for each projection group of a layer (q/k/v, o, gate/up, down), one CUDA graph of 20 calls each, timed by
replays (microseconds a call, --rows rows):

  base                the group's base GEMM alone (the engine without LoRA)
  base+A              with the group's adapters' A rows under it (rank 16, 4 slots + the base's: 80 rows a member;
                      today's graph step: the base GEMM is the shrink too)
  base+A_pad128/256   the same, rows padded to a multiple of 128 / 256
  shrink_alone        the shrink as a GEMM of its own
  mask_mul            the rows' slot mask times the shrink output
  expand              the block-diagonal expand GEMM; expand_addmm_inplace: accumulated onto the base output

    python bench/lora_decode_gemms.py --out /tmp/lora_decode_gemms_gpu.json     # a GPU; ~20 s
"""
import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

# (in features, out features of the group, A rows under it, bias) at Qwen2.5-1.5B, 4 adapter slots of rank 16
GROUPS = {"qkv": (1536, 2048, 240, True), "o": (1536, 1536, 80, False), "gate_up": (1536, 17920, 160, False),
          "down": (8960, 1536, 80, False)}


def timed(fn, reps=200):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return round(a.elapsed_time(b) * 1e3 / reps / 20, 2)      # microseconds per call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev, dt, M = "cuda", torch.bfloat16, args.rows
    out = {"benchmark": "lora_decode_gemms", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "rows": M, "unit": "microseconds a call"}
    for name, (k, n, kw, bias) in GROUPS.items():
        x = torch.randn(M, k, device=dev, dtype=dt)
        r = {}
        for label, rows in (("base", n), ("base+A", n + kw), ("base+A_pad128", -(-(n + kw) // 128) * 128),
                            ("base+A_pad256", -(-(n + kw) // 256) * 256)):
            w = torch.randn(rows, k, device=dev, dtype=dt) * 0.02
            b_ = torch.zeros(rows, device=dev, dtype=dt) if bias else None
            r[label] = timed(lambda w=w, b_=b_: F.linear(x, w, b_))
        a = torch.randn(kw, k, device=dev, dtype=dt) * 0.02
        r["shrink_alone"] = timed(lambda: F.linear(x, a))
        h = torch.randn(M, kw, device=dev, dtype=dt)
        mask = (torch.rand(M, kw, device=dev) > 0.8).to(dt)
        B = torch.randn(n, kw, device=dev, dtype=dt) * 0.02
        y = torch.randn(M, n, device=dev, dtype=dt)
        r["mask_mul"] = timed(lambda: h * mask)
        r["expand"] = timed(lambda: F.linear(h, B))
        r["expand_addmm_inplace"] = timed(lambda: y.addmm_(h, B.t()))
        out[name] = r
        print(name, r, flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
