"""Where a CUDA-graph decode step's time goes, and what the Triton kernels change: sampler and attention variants.

The GRPO GPU step's rollout shape: a Qwen2.5-0.5B-shaped random bf16 model, --prompts distinct prompts
of --prompt-len tokens, each sampled --n times (512 rows), --new-tokens new tokens, temperature 1, top_p 1.
Variants of services/rollout/engine_torch/cuda_decode.GraphDecoder, all in one process on the same prompts:

  torch            torch sampler (a dozen fp32 passes over [B, V]) and torch attention over the whole bucket
  fused_sampler    the one-pass Triton sampler (services/rollout/engine_torch/fused_sample.py), torch attention
  fused            the Triton sampler and the length-aware Triton attention
                   (services/rollout/engine_torch/decode_attention.py)
  fused_bn32, ...  the same with other attention tilings (slots per iteration, warps): for tuning
  fused_seeded_stop  fused, every row seeded (its own Philox key) and a stop string checked on the host at each
                   sync over the steps since the last one (as TorchEngine does: a tail decode per running row,
                   here through a synthetic 151,936-entry vocabulary of 1-6 character strings; the stop string
                   never occurs, so every row runs its full budget as in the unseeded variant)
  fused_seeded_stop_top5  the same, each step's top-5 log-probs recorded too

Every variant uses the decoder's one-GEMM q/k/v projection.

Per variant: seconds per decode call (median of --repeats after a first call that compiles and captures),
ms per token step, tokens/s, and a torch.profiler breakdown of 16 replays of the captured step (device ms
per step by kernel kind). The fused variant's sampled log-probs are checked against a full forward pass.

    PYTHONPATH=.:protos python bench/decode_step.py [--out bench/results/decode_step_gpu.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402

from rollout_gpu import EOS, PAD, QWEN25_05B, build_model  # noqa: E402
from services.common.tensors.modeling import response_logprobs  # noqa: E402
from services.rollout.engine_torch import decode_attention  # noqa: E402
from services.rollout.engine_torch.cuda_decode import GraphDecoder  # noqa: E402

VARIANTS = {"torch": dict(fused_sampler=False, triton_attention=False),
            "fused_sampler": dict(fused_sampler=True, triton_attention=False),
            "fused": dict(fused_sampler=True, triton_attention=True),
            "fused_seeded_stop": dict(fused_sampler=True, triton_attention=True),
            "fused_seeded_stop_top5": dict(fused_sampler=True, triton_attention=True)}
# Attention tilings tried beside the shipped one (decode_attention.BLOCK_N, NUM_WARPS): name -> (block, warps).
ATTENTION_TILES = {"fused_bn64": (64, 4), "fused_bn128": (128, 4), "fused_bn64_w2": (64, 2), "fused_bn128_w8": (128, 8)}
KINDS = (("sampler_triton", ("_sample_kernel", "_sample_part", "_sample_combine")), ("attention_triton", ("_decode_attn",)),
         ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90", "splitk")),
         ("compiled_elementwise", ("triton_",)), ("torch_elementwise_reduce", ("elementwise", "reduce", "softmax",
                                                                            "exponential", "distribution", "index")))


def kernel_breakdown(graph, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
    kinds: dict[str, float] = {}
    top = []
    for item in prof.key_averages():
        us = getattr(item, "self_device_time_total", 0) or 0
        if us <= 0:
            continue
        name = item.key.lower()
        kind = next((k for k, pats in KINDS if any(p in name for p in pats)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + us / 1e3 / steps
        top.append((us / 1e3 / steps, item.count // steps, item.key[:80]))
    top.sort(reverse=True)
    return {"device_ms_per_step": round(sum(kinds.values()), 3),
            "by_kind_ms_per_step": {k: round(v, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "top_kernels": [{"ms_per_step": round(ms, 4), "calls_per_step": n, "name": k} for ms, n, k in top[:15]]}


def stop_string_check(vocab_size: int, stop: str = "\x00STOP"):
    """A host stop-string check with TorchEngine's cost: the tail since the last check (plus the stop string's
    length) decoded through a vocabulary, then searched."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 7, (vocab_size,), generator=g).tolist()
    vocab = ["abcdefghij"[:n] for n in lengths]

    def check(row: int, tokens: list, since: int) -> bool:
        return stop in "".join(vocab[t] for t in tokens[max(0, since - len(stop)):])
    return check


def decode_options(name: str, R: int, vocab_size: int) -> dict:
    """The extra sampling options of a variant's decode call."""
    if not name.startswith("fused_seeded_stop"):
        return {}
    return {"seeds": [1000 + i for i in range(R)], "stop_check": stop_string_check(vocab_size),
            "top_logprobs": 5 if name.endswith("_top5") else 0}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"of {', '.join([*VARIANTS, *ATTENTION_TILES])}")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "decode_step_gpu.json"))
    args = parser.parse_args(argv)
    dev = "cuda"
    model = build_model(QWEN25_05B, dev, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    uniq = [torch.randint(3, 150000, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    prompts = [p for p in uniq for _ in range(args.n)]
    R, T = len(prompts), args.new_tokens
    out = {"benchmark": "decode_step", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "python": platform.python_version(), "rows": R, "prompt_len": args.prompt_len, "new_tokens": T,
           "model": "Qwen2.5-0.5B-shaped, random init, bf16", "variants": {}}
    shipped = (decode_attention.BLOCK_N, decode_attention.NUM_WARPS)
    for name in args.variants.split(","):
        decode_attention.BLOCK_N, decode_attention.NUM_WARPS = ATTENTION_TILES.get(name, shipped)
        dec = GraphDecoder(model, pad_id=PAD, eos_ids=[EOS], max_batch_size=R,
                           **VARIANTS.get(name, VARIANTS["fused"]))
        options = decode_options(name, R, model.config.vocab_size)

        def call():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            res = dec.decode(prompts, [T] * R, [1.0] * R, [1.0] * R, **options)
            torch.cuda.synchronize()
            return time.perf_counter() - t0, res

        first, _ = call()
        times = []
        for _ in range(args.repeats):
            t, res = call()
            times.append(t)
        tokens = sum(len(t) for t in res[0])
        st = next(iter(dec._states.values()))
        graph = next(iter(st.graphs.values()))
        sec = statistics.median(times)
        entry = {"attention_tile": [decode_attention.BLOCK_N, decode_attention.NUM_WARPS], "first_call_s": round(first, 2), "times_s": [round(t, 4) for t in times], "seconds": round(sec, 4),
                 "ms_per_step": round(sec / T * 1e3, 3), "tokens": tokens, "tokens_per_s": round(tokens / sec),
                 "active": {"fused_sampler": dec.fused_sampler, "triton_attention": dec.triton_attention},
                 "profile": kernel_breakdown(graph, 16)}
        if name == "fused":
            rows = list(range(0, R, R // 8))[:8]
            ref, _ = response_logprobs(model, [prompts[i] for i in rows], [res[0][i] for i in rows], pad_id=PAD)
            d = torch.cat([(ref[j, :len(res[1][i])].float().cpu() - torch.tensor(res[1][i])).abs()
                           for j, i in enumerate(rows)])
            entry["logprob_parity_vs_forward"] = {"rows": len(rows), "max_abs_diff": round(float(d.max()), 5),
                                                  "mean_abs_diff": round(float(d.mean()), 6)}
        out["variants"][name] = entry
        print(name, json.dumps({k: v for k, v in entry.items() if k != "profile"}), flush=True)
        print("  ", json.dumps(entry["profile"]["by_kind_ms_per_step"]), flush=True)
        del dec
        torch.cuda.empty_cache()
    base = out["variants"].get("torch", {}).get("seconds")
    for e in out["variants"].values():
        if base:
            e["speedup_vs_torch"] = round(base / e["seconds"], 3)
    fast = out["variants"].get("fused", {}).get("tokens_per_s")
    for name in ("fused_seeded_stop", "fused_seeded_stop_top5"):
        if fast and name in out["variants"]:     # goal (issue 27): >= 0.9 of the unseeded fast path
            out["variants"][name]["tokens_per_s_vs_fused"] = round(out["variants"][name]["tokens_per_s"] / fast, 3)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
