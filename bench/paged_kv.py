"""The torch engine's paged KV cache (rollout.kv_cache: paged) beside today's engine (kv_cache: none, CUDA-graph
decode), in one process on one GPU, on a random Qwen2.5-0.5B-shaped model in bf16 (issue 44's goals):

  grpo      64 prompts of 1,024 random tokens, n=8, 256 new tokens: rows/s and tokens/s (goal: paged >= 1.5x)
  decode    256 prompts of 64 tokens, n=1, 256 new tokens: plain decode (goal: paged no slower)
  (each case runs the variants none, paged and paged_graphs: paged with rollout.kv_cache_cuda_graphs;
  VARIANT/K: that variant with windows of K decode steps per host sync, e.g. paged_graphs/32; paged_graphs-noshare:
  without the shared-prefix attention, each row reading its group's prompt itself; -nochain: each window launched
  after the host settled the one before it, not before (window.py's chained windows off); -ppsN (N = 1..9): the
  shared-prefix kernel's grid filled to N programs an SM (cascade.PREFIX_PROGRAMS_PER_SM); suffixes combine)
  longtail  512 rows with lognormal budgets (median 96, cap 1,024): today's engine decodes 64 rows at a time, its
            cache holding each at prompt + the longest budget; paged gets those bytes (kv_cache_gib) and runs as many
            rows as their lengths fit: its peak running rows vs 64, and tokens/s (goal: >= 2x the rows)

Each case: one untimed call first (compile, graph capture), then --repeats timed calls, median. The episodes goal
(tool episodes vs one generate of the same tokens) is bench/episodes.py --kv-cache paged (gpu_session.sh paged_kv).

    PYTHONPATH=.:protos python bench/paged_kv.py --out /tmp/paged_kv_gpu.json        # bench/gpu_session.sh paged_kv
    PYTHONPATH=.:protos python bench/paged_kv.py --device cpu --tiny                  # smoke test of the script
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")           # the models are random-init: nothing from a hub

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.rollout_gpu import QWEN25_05B, TINY, build_model  # noqa: E402
from services.rollout.config import RolloutSettings  # noqa: E402
from services.rollout.engine_torch.engine import TorchEngine, _Job  # noqa: E402
from services.rollout.types import GenerateBatch, PromptInput, SamplingParams  # noqa: E402


def engine(model, args, variant: str, **rollout) -> TorchEngine:
    """none: today's engine (CUDA graphs on a GPU); paged: eager paged steps; paged_graphs: + kv_cache_cuda_graphs."""
    cuda = args.device.startswith("cuda")
    kv_cache = "none" if variant == "none" else "paged"
    if kv_cache == "paged":             # explicit both ways: auto turns the graphs on with CUDA
        rollout["kv_cache_cuda_graphs"] = variant == "paged_graphs"
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    settings = RolloutSettings(model={"path": "random-init", "device": args.device, "dtype": dtype},
                               rollout={"cuda_graphs": cuda and kv_cache == "none", "kv_cache": kv_cache,
                                        "max_batch_size": 512, "max_tokens": 256, **rollout})
    eng = TorchEngine(settings, model=model, tokenizer=None)
    eng.eos_ids = set()                        # every row samples its whole budget (the graph decoder's eos: -1)
    if eng._graph_decoder is not None:
        eng._graph_decoder._eos = torch.tensor([-1], device=eng._graph_decoder.device)
    return eng


def batches(prompts: list[list[int]], n: int, budgets: list[int]) -> list[_Job]:
    """One job per distinct budget (a request each), prompts in order."""
    jobs = []
    for b in sorted(set(budgets)):
        mine = [p for p, x in zip(prompts, budgets) if x == b]
        batch = GenerateBatch([PromptInput(id=f"p{i}", prompt_ids=p) for i, p in enumerate(mine)],
                              SamplingParams(n=n, temperature=1.0, max_tokens=b))
        jobs.append(_Job(batch, [list(p) for p in mine], None))
    return jobs


def timed(eng: TorchEngine, jobs_fn, repeats: int, device: str) -> dict:
    def once():
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = eng._generate_jobs(jobs_fn())
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t0, sum(len(s.response_ids) for res in out for r in res for s in r.samples)

    first, _ = once()
    runs = [once() for _ in range(repeats)]
    secs = statistics.median(s for s, _ in runs)
    tokens = runs[0][1]
    info = eng.info()
    keep = ("preemptions", "resumed_rows", "prefill_tokens", "prefill_tokens_saved", "max_running_rows",
            "prefix_cache_hit_rate", "kv_blocks_total", "cow_copies", "decode_steps", "decode_syncs",
            "chained_windows")
    return {"first_call_s": round(first, 3), "seconds": round(secs, 3), "tokens": tokens,
            "tokens_per_s": round(tokens / secs, 1), **{k: info[k] for k in keep if k in info}}


def case(model, args, name: str, shape: tuple[int, int], n: int, budgets, none_rollout: dict | None = None,
         **paged_rollout) -> dict:
    """Both engines on the same calls; each call's prompts are new random ones (a GRPO step's prompts are new,
    so no call finds the previous one's prompts in the prefix cache)."""
    out = {}
    from services.rollout.engine_torch.paged import cascade, decoder

    default_window, default_pps = decoder.SYNC_EVERY, cascade.PREFIX_PROGRAMS_PER_SM
    for kv in args.variants.split(","):
        try:
            # "paged_graphs/32": that variant with windows of 32 decode steps per host sync (default 16)
            # "paged_graphs-noshare": without the shared-prefix attention (every row reads its group's prompt)
            # "paged_graphs-nochain": windows launched after the one before was settled
            base, _, window = kv.partition("/")
            base, *flags = base.split("-")
            pps = [int(f[3:]) for f in flags if re.fullmatch(r"pps[1-9]", f)]
            if set(flags) - {"noshare", "nochain"} - {f"pps{n}" for n in pps} or len(pps) > 1:
                raise ValueError(f"--variants: unknown suffix in {kv!r} (noshare, nochain, ppsN)")
            cascade.PREFIX_PROGRAMS_PER_SM = pps[0] if pps else default_pps
            decoder.SYNC_EVERY = int(window or default_window)
            eng = engine(model, args, base, **(dict(paged_rollout) if base != "none" else none_rollout or {}))
            graphs = eng._paged.graphs if eng._paged is not None else None
            if graphs is not None:
                graphs.shared_prefix = graphs.shared_prefix and "noshare" not in flags
            if eng._paged is not None:
                eng._paged.chain_windows = "nochain" not in flags
            g = torch.Generator().manual_seed(0)
            fresh = lambda: torch.randint(3, model.config.vocab_size, shape, generator=g).tolist()  # noqa: E731
            out[kv] = timed(eng, lambda: batches(fresh(), n, budgets), args.repeats, args.device)
            if graphs is not None:
                out[kv]["shared_prefix_rows"] = graphs.stats["shared_prefix_rows"]
        except Exception as e:            # one variant failing (paged_graphs: first GPU run) keeps the others
            out[kv] = {"error": f"{type(e).__name__}: {e}"[:500]}
        eng = None
        decoder.SYNC_EVERY, cascade.PREFIX_PROGRAMS_PER_SM = default_window, default_pps
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        print(name, kv, out[kv], flush=True)
    for kv in list(out):
        if kv != "none" and "tokens_per_s" in out[kv] and "tokens_per_s" in out.get("none", {}):
            out[f"{kv}_vs_none"] = round(out[kv]["tokens_per_s"] / out["none"]["tokens_per_s"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny model and small cases (CPU smoke test)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--cases", default="grpo,decode,longtail")
    ap.add_argument("--variants", default="none,paged,paged_graphs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    shape = TINY if args.tiny else QWEN25_05B
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    model = build_model(shape, args.device, dtype)
    scale = 16 if args.tiny else 1
    results = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
               "torch": torch.__version__, "shape": "tiny" if args.tiny else "qwen2.5-0.5b"}
    def save() -> None:   # after each case: a run stopped at its time limit keeps the cases it finished
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1) + "\n")

    if "grpo" in args.cases:
        results["grpo"] = case(model, args, "grpo", (64 // scale, 1024 // scale), 8, [256 // scale] * (64 // scale))
        save()
    if "decode" in args.cases:
        results["decode"] = case(model, args, "decode", (256 // scale, 64), 1, [256 // scale] * (256 // scale))
        save()
    if "longtail" in args.cases:
        # 512 rows; today's engine decodes 64 at a time (its cache holds each at prompt + the longest budget), paged
        # gets the bytes of those 64 full-length rows and runs as many rows as their actual lengths fit.
        rows, cap, today_rows = 512 // scale, 1024 // scale, 64 // scale
        torch.manual_seed(1)
        budgets = torch.distributions.LogNormal(torch.log(torch.tensor(96.0 / scale)), 0.8).sample((rows,))
        budgets = [int(min(cap, max(1, b))) for b in budgets.tolist()]
        # Today's static cache: every row at prompt + the longest budget; paged gets those bytes.
        from services.rollout.engine_torch.paged.kv import block_bytes
        same_bytes = today_rows * (64 + max(budgets)) * block_bytes(model, 1)
        results["longtail"] = case(model, args, "longtail", (rows, 64), 1, budgets,
                                   none_rollout={"max_batch_size": today_rows}, kv_cache_gib=same_bytes / 2**30)
        lt = results["longtail"]
        lt["budgets"] = {"median": statistics.median(budgets), "max": max(budgets), "rows": rows,
                         "kv_gib": round(same_bytes / 2**30, 3)}
        paged = next((lt[v] for v in ("paged_graphs", "paged") if "max_running_rows" in lt.get(v, {})), {})
        peak = paged.get("max_running_rows", 0)
        lt["concurrent_rows"] = {"none": today_rows, "paged": peak, "paged_vs_none": round(peak / today_rows, 2)}
    save()
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
