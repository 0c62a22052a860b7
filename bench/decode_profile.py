"""Where a decode step's GPU time goes: the torch engine's decode call under torch.profiler, per variant, beside its
baseline in the same process (a diagnostic for issues 43 and 44; the speed goals themselves are bench/lora_gpu.py
and bench/paged_kv.py):

  lora    Qwen2.5-1.5B shape, 128 prompts of 128 tokens, 64 new tokens: an engine without LoRA (`nolora`, the
          baseline), the LoRA engine's base rows (`lora_base`) and rows of 4 adapters (`lora_4`)
  paged   Qwen2.5-0.5B shape, 256 prompts of 64 tokens (--prompt-len), 64 new tokens: kv_cache none (the baseline) and paged with
          its CUDA graphs (`paged_graphs`)

For each variant: one untimed call (compile, capture), one timed call, then one call under the profiler: wall
seconds, kernel time and launches per decode step, and the kernels that took the most time.

    PYTHONPATH=.:protos python bench/decode_profile.py --out /tmp/decode_profile_gpu.json   # gpu_session.sh profile
    PYTHONPATH=.:protos python bench/decode_profile.py --device cpu --tiny --out /tmp/p.json  # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "protos"), str(REPO / "bench")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")           # random-init models: nothing from a hub

import torch  # noqa: E402


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# The decode attention kernels (engine_torch/decode_attention.py, paged/attention.py, paged/cascade.py): the part of a
# step a KV cache's layout changes; the rest (GEMMs, norms, sampling) is the same work in either engine.
ATTENTION_KERNELS = ("_decode_attn", "_paged_decode_kernel", "_group_prefix_kernel", "_combine_kernel")


def profiled(call, device: str, steps: int, top: int) -> dict:
    """call() once untimed, once timed, once under the profiler."""
    call()
    sync(device)
    t0 = time.perf_counter()
    call()
    sync(device)
    wall = time.perf_counter() - t0
    out = {"call_s": round(wall, 4), "ms_per_step": round(1e3 * wall / steps, 3)}
    if not device.startswith("cuda"):
        return out
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        sync(device)
    out["idle"] = idle_gaps(prof, steps)
    out["host"] = host_profile(call, device)
    rows = [r for r in prof.key_averages() if r.device_time_total > 0]
    total = sum(r.device_time_total for r in rows)
    launches = sum(r.count for r in rows)
    rows.sort(key=lambda r: r.device_time_total, reverse=True)
    attention = sum(r.device_time_total for r in rows if r.key.startswith(ATTENTION_KERNELS))
    out.update(kernel_ms_per_step=round(total / 1e3 / steps, 3), launches_per_step=round(launches / steps, 1),
               attention_ms_per_step=round(attention / 1e3 / steps, 4),
               kernels_top=[[r.key[:90], round(r.device_time_total / 1e3 / steps, 4), round(r.count / steps, 2)]
                            for r in rows[:top]])
    return out


def host_profile(call, device: str, top: int = 15) -> dict:
    """One more call under cProfile: the host functions with the most time of their own (a GPU wait shows as the
    call that synchronises) and meshrl's own functions by cumulative time, in ms for the whole call."""
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    call()
    sync(device)
    pr.disable()
    stats = pstats.Stats(pr).stats
    name = lambda f: f"{Path(f[0]).name}:{f[1]}({f[2]})" if f[0] != "~" else f[2]    # noqa: E731
    own = sorted(((tt, nc, name(f)) for f, (_, nc, tt, _, _) in stats.items()), reverse=True)
    cumulative = sorted((ct, nc, name(f)) for f, (_, nc, _, ct, _) in stats.items() if "/services/" in f[0])[::-1]
    return {key: [[n, round(1e3 * ms, 1), calls] for ms, calls, n in rows[:top]]
            for key, rows in (("own_ms", own), ("meshrl_cumulative_ms", cumulative))}


def idle_gaps(prof, steps: int, big_us: float = 20.0, top: int = 8) -> dict:
    """Where the GPU sat idle during the profiled call (kernel timeline from the profiler's trace): idle ms a step
    before the first decode attention kernel (prefill and set-up) and after it (decode), the idle in gaps over
    `big_us`, and the largest gaps with the kernels either side."""
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    kernels = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in trace.get("traceEvents", [])
                     if e.get("cat") == "kernel" and "dur" in e)
    if not kernels:
        return {}
    first_attn = next((t0 for t0, _, n in kernels if n.startswith(ATTENTION_KERNELS)), kernels[-1][0])
    gaps, end, prev = [], kernels[0][1], kernels[0][2]
    for t0, t1, name in kernels[1:]:
        if t0 > end:
            gaps.append((t0 - end, t0, prev, name))
        if t1 > end:
            end, prev = t1, name
    ms = lambda us: round(us / 1e3 / steps, 4)                                  # noqa: E731
    gaps.sort(reverse=True)
    return {"before_decode_ms_per_step": ms(sum(g for g, t, *_ in gaps if t <= first_attn)),
            "decode_ms_per_step": ms(sum(g for g, t, *_ in gaps if t > first_attn)),
            f"in_gaps_over_{int(big_us)}us_ms_per_step": ms(sum(g for g, *_ in gaps if g > big_us)),
            "gaps_over_big": sum(1 for g, *_ in gaps if g > big_us),
            "largest_us": [[round(g, 1), round((t - kernels[0][0]) / 1e3, 2), a[:50], b[:50]]
                           for g, t, a, b in gaps[:top]]}


def lora_part(args) -> dict:
    from lora_gpu import adapter_config, adapter_tensors, build_model, lora_settings
    from services.rollout.engine_torch.engine import TorchEngine, _Job
    from services.rollout.types import GenerateBatch, PromptInput, SamplingParams

    size = "tiny" if args.tiny else "1.5b"
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    g = torch.Generator().manual_seed(3)
    vocab = 512 if args.tiny else 151936
    prompts = torch.randint(1, vocab, (args.batch, 128), generator=g).tolist()
    out = {}
    for variant in ("nolora", "lora_base", "lora_4"):
        if variant != "lora_4":
            model = build_model(size, args.device, getattr(torch, dtype))
            engine = TorchEngine(lora_settings(size, args.device, dtype, lora=variant != "nolora", rank=16,
                                               max_loras=4), model=model, tokenizer=None)
            engine.warm_up()
        names = [""]
        if variant == "lora_4":
            names = [f"a{i}" for i in range(4)]
            for i, name in enumerate(names):
                engine.load_adapter(name, 1, adapter_config(16), adapter_tensors(model, 16, model.dtype, args.device,
                                                                                 seed=10 + i))
        per = -(-len(prompts) // len(names))

        def call():
            jobs = [GenerateBatch([PromptInput(id=str(i), prompt_ids=p) for i, p in enumerate(prompts[k * per:
                                                                                                  (k + 1) * per])],
                                  SamplingParams(n=1, temperature=1.0, max_tokens=args.new_tokens, adapter=a))
                    for k, a in enumerate(names)]
            engine._generate_jobs([_Job(b, engine.check_batch(b), None) for b in jobs])
        out[variant] = profiled(call, args.device, args.new_tokens, args.top)
        print(variant, json.dumps(out[variant])[:300], flush=True)
    for v in ("lora_base", "lora_4"):
        out[f"{v}_step_vs_nolora"] = round(out[v]["ms_per_step"] / out["nolora"]["ms_per_step"], 3)
    return out


def paged_part(args) -> dict:
    from lora_gpu import SHAPES
    from paged_kv import batches, engine
    from rollout_gpu import QWEN25_05B, TINY, build_model

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    shape = TINY if args.tiny else QWEN25_05B if args.paged_shape == "0.5b" else SHAPES[args.paged_shape]
    model = build_model(shape, args.device, dtype)
    if args.paged_tile_elements:                    # the paged kernel's K/V tile (attention.TILE_ELEMENTS), to sweep
        from services.rollout.engine_torch.paged import attention
        attention.TILE_ELEMENTS = args.paged_tile_elements
    args.variants = "none,paged_graphs" if args.device.startswith("cuda") else "none,paged"
    out = {}
    for variant in args.variants.split(","):
        eng = engine(model, args, variant)
        g = torch.Generator().manual_seed(0)
        shape = (2 * args.batch // args.n, args.prompt_len)     # n samples of each prompt (a GRPO group)

        def call():
            prompts = torch.randint(3, model.config.vocab_size, shape, generator=g).tolist()
            eng._generate_jobs(batches(prompts, args.n, [args.new_tokens] * shape[0]))
        out[variant] = profiled(call, args.device, args.new_tokens, args.top)
        print(variant, json.dumps(out[variant])[:300], flush=True)
        eng = None
    other = [v for v in out if v != "none"][0]
    out[f"{other}_step_vs_none"] = round(out[other]["ms_per_step"] / out["none"]["ms_per_step"], 3)
    none = out["none"]
    if "attention_ms_per_step" in none:
        # The most any KV cache layout can gain over none here: its step with attention taking no time at all
        # (kernels only, and wall time with the same idle time a step).
        rest = none["kernel_ms_per_step"] - none["attention_ms_per_step"]
        out["none_speedup_bound_if_attention_were_free"] = {
            "kernels": round(none["kernel_ms_per_step"] / rest, 3),
            "wall": round(none["ms_per_step"] / (none["ms_per_step"] - none["attention_ms_per_step"]), 3)}
    return out


PARTS = {"lora": lora_part, "paged": paged_part}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="lora,paged")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64, help="the paged part's prompt tokens")
    ap.add_argument("--n", type=int, default=1, help="the paged part's samples per prompt (rows = 2 x batch)")
    ap.add_argument("--paged-shape", default="0.5b", choices=["0.5b", "1.5b"], help="the paged part's model shape")
    ap.add_argument("--paged-tile-elements", type=int, default=0, help="the paged kernel's tile (0: its own)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    result = {"benchmark": "decode_profile", "device": torch.cuda.get_device_name() if args.device.startswith("cuda")
              else "cpu", "torch": torch.__version__, "batch": args.batch, "new_tokens": args.new_tokens}
    for part in args.parts.split(","):
        try:
            result[part] = PARTS[part](args)
        except Exception as e:            # one part failing keeps the other's figures
            result[part] = {"error": f"{type(e).__name__}: {e}"[:800]}
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict)}))


if __name__ == "__main__":
    main()
