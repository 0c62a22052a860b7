"""Tokens/s and MFU of the trainer's TrainActor path on one GPU, beside a plain transformers + AdamW loop.

Models: Qwen2.5-0.5B- and 1.5B-shaped Qwen2 configs with random weights (saved with save_pretrained
and loaded by the trainer as any model folder). Batch: 8 sequences of 2048 tokens (1 prompt token +
2047 response tokens, so the trainer's loss covers the same positions as the plain loop's LM loss),
one optimizer step per call (mini_batch_size 0, ppo_epochs 1). Variants, all measured in one run:

  plain              AutoModelForCausalLM in bf16, model(ids, labels=ids).loss, backward,
                     clip_grad_norm_, torch.optim.AdamW (default foreach), zero_grad
  engine             TrainerEngine.train_actor as shipped, CUDA defaults (model.dtype bf16: bf16 params and
                     AdamW state): actor.fused_logprobs (LM head + log-prob/entropy in Triton kernels, no fp32
                     [tokens, vocab] tensors), actor.compile (torch.compile of each decoder block), fused
                     AdamW, a grad norm with one host sync, loss stats kept on the device
  engine_amp         the same with fp32 master weights (actor.param_dtype float32, actor.dtype bfloat16)
  engine_bf16        the same in bf16 only (actor.param_dtype bfloat16: bf16 weights and AdamW state)
  engine_eager       the same with actor.compile false
  engine_unfused     actor.compile false and actor.fused_logprobs false (fused AdamW, one-sync norm remain)

MFU = model FLOPs / step time / peak, model FLOPs = 6 * N * tokens + 12 * layers * hidden * seq * tokens
(torchtitan's count: N = parameters with the tied embedding once, attention not halved for the causal
mask); peak = 989 TFLOP/s, the H200 SXM datasheet's dense bf16 rate. The run also measures an
8192^3 bf16 matmul and reports MFU against that ceiling too.

    PYTHONPATH=.:protos python bench/trainer_mfu.py [--sizes 0.5b,1.5b] [--out bench/results/trainer_mfu.json]
    PYTHONPATH=.:protos python bench/trainer_mfu.py --device cpu --tiny      # smoke test of the script
    PYTHONPATH=.:protos python bench/trainer_mfu.py --device cpu --tiny --actor '{"fused_logprobs": true}'

The engine variants run with the trainer's defaults: the fused head, compile and fp32 master weights (model.dtype
bfloat16 makes them the default since #23, so `engine` and `engine_amp` are now the same configuration); remove
padding is on by default on CUDA, but 8 rows of one length have no padding to remove and run as [8, 2048]. The length-spread workload (packed vs padded tokens/s on long-tailed
lengths) and the fused head's peak memory against full logits are bench/trainer_packing.py, which reuses this
file's model shapes: `bench/gpu_session.sh packing`.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from services.common.config import load_config  # noqa: E402
from services.common.tensors.modeling import response_logprobs  # noqa: E402
from services.common.tensors import fused  # noqa: E402
from services.trainer.batch import validate_actor_batch  # noqa: E402
from services.trainer.types import ActorLoss, TrainSample  # noqa: E402

PEAK_BF16 = 989e12
SHAPES = {
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=1000, tie_word_embeddings=True),
}

# --------------------------------------------------------------------------------------------------
# Measurement


def sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def model_flops_per_step(cfg: dict, num_params: int, batch: int, seq: int) -> float:
    tokens = batch * seq
    return 6 * num_params * tokens + 12 * cfg["num_hidden_layers"] * cfg["hidden_size"] * seq * tokens


def save_model(shape: dict, path: Path, dev: str) -> int:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**shape, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(dev):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    n = model.num_parameters()
    del model
    return n


def make_samples(batch: int, seq: int, vocab: int) -> list[TrainSample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(batch):
        ids = torch.randint(3, vocab, (seq,), generator=g).tolist()
        r = seq - 1
        out.append(TrainSample(prompt_ids=ids[:1], response_ids=ids[1:], advantages=torch.randn(r, generator=g).tolist(),
                               old_logprobs=[-math.log(vocab)] * r))
    return out


def time_steps(step, warmup: int, steps: int, dev: str) -> list[float]:
    for _ in range(warmup):
        step()
    sync(dev)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync(dev)
        times.append(time.perf_counter() - t0)
    return times


def run_plain(path: str, samples, dev: str, warmup: int, steps: int, dtype) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).to(dev)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.tensor([s.prompt_ids + s.response_ids for s in samples], device=dev)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = time_steps(step, warmup, steps, dev)
    del model, opt
    return {"times": times}


def build_engine(path: str, dev: str, *, amp: bool, dtype: str, budget: int, overrides: dict):
    from services.trainer.config import TrainerSettings
    from services.trainer.engine import TrainerEngine

    actor = {"lr": 1e-6, "micro_batch_token_budget": budget, **overrides}
    if amp:
        actor.update(param_dtype="float32", dtype="bfloat16")
    return TrainerEngine(load_config(TrainerSettings, data={"model": {"path": path, "dtype": dtype, "device": dev},
                                                            "actor": actor}))


def run_engine(path: str, samples, dev: str, warmup: int, steps: int, *, amp: bool, overrides: dict,
               dtype: str, budget: int, parity: bool, profile: bool = False, trace: str | None = None) -> dict:
    engine = build_engine(path, dev, amp=amp, dtype=dtype, budget=budget, overrides=overrides)
    extra = {"fused_logprobs": engine.rank.fused_logprobs,
             "adamw": "fused" if engine.rank.actor.optimizer.defaults.get("fused") else
                      "foreach" if engine.rank.actor.optimizer.defaults.get("foreach") else "for-loop"}
    if parity and engine.rank.fused_logprobs:
        extra["fused_head_parity"] = head_parity(engine, samples, dev)
    loss = ActorLoss()
    metrics = []

    def step():
        metrics.append(engine.train_actor(samples, loss))

    times = time_steps(step, warmup, steps, dev)
    if profile:
        extra["profile"] = profile_step(step, dev, trace)
    engine.close()
    internal = [m["seconds"] for m in metrics[-steps:]]
    del engine
    return {"times": times, "engine_reported_seconds": internal, "last_metrics": {
        k: metrics[-1][k] for k in ("loss", "grad_norm", "entropy", "num_optimizer_steps")}, **extra}


KERNEL_KINDS = (("lm_head_logprob_triton", ("_head_fwd", "_head_bwd")), ("flash_attention", ("flash", "fmha", "attention")),
                ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90")),
                ("optimizer", ("adam", "multi_tensor")), ("compiled_elementwise", ("triton_",)),
                ("embedding", ("embedding",)), ("reduce_norm", ("reduce", "norm")))


def profile_step(step, dev: str, trace: str | None = None) -> dict:
    """Device time of one step by kernel kind (torch.profiler), against its wall time; and the GPU's idle
    gaps of the step (between kernels, and before the first) with the host code running in each."""
    from torch.profiler import ProfilerActivity, profile, record_function

    sync(dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        t0 = time.perf_counter()
        with record_function("bench_step"):
            step()
        sync(dev)
        wall = time.perf_counter() - t0
    if trace:
        prof.export_chrome_trace(trace)
    kinds: dict[str, float] = {}
    top = []
    for item in prof.key_averages():
        us = getattr(item, "self_device_time_total", 0) or 0
        if us <= 0 or getattr(item, "device_type", None) is None or "CUDA" not in str(item.device_type) \
                or item.key == "bench_step":               # the step's own range on the GPU timeline
            continue
        name = item.key.lower()
        kind = next((k for k, pats in KERNEL_KINDS if any(p in name for p in pats)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + us / 1e3
        top.append((us / 1e3, item.count, item.key[:90]))
    top.sort(reverse=True)
    busy = sum(kinds.values())
    return {"wall_ms": round(wall * 1e3, 1), "gpu_busy_ms": round(busy, 1),
            "by_kind_ms": {k: round(v, 1) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "top_kernels": [{"ms": round(ms, 2), "calls": n, "name": k} for ms, n, k in top[:25]],
            "trace": _safe(trace_profile, trace) if trace else None}


def _safe(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - an analysis bug must not lose the measured step
        return {"error": f"{type(e).__name__}: {e}"}


def trace_profile(trace: str, min_us: float = 100.0) -> dict:
    """From a profiled step's Chrome trace: device busy time by kernel kind, and the GPU's idle gaps (before
    the first kernel and between kernels, over min_us) with the innermost host code running at each gap's
    middle. Works on the file alone: `python bench/trainer_mfu.py --analyze-trace trace.json[.gz]`."""
    import gzip

    opener = gzip.open if trace.endswith(".gz") else open
    with opener(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    step = next(e for e in events if e.get("name") == "bench_step" and e.get("cat") == "user_annotation")
    t0 = step["ts"]
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
    host = [e for e in events if e.get("cat") in ("python_function", "cpu_op") and "dur" in e]
    kinds: dict[str, float] = {}
    for e in kernels:
        name = e["name"].lower()
        kind = next((k for k, pats in KERNEL_KINDS if any(p in name for p in pats)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + e["dur"] / 1e3

    def host_at(t: float) -> list[str]:
        cover = sorted((e for e in host if e["ts"] <= t <= e["ts"] + e["dur"]), key=lambda e: e["dur"])
        return [e["name"][:100] for e in cover if "services/" in e["name"] or "aten::" in e["name"]][:4]

    gaps = [(kernels[0]["ts"] - t0, t0, kernels[0]["ts"])]
    end = kernels[0]["ts"] + kernels[0]["dur"]
    small = 0.0
    for e in kernels[1:]:
        gap = e["ts"] - end
        if gap > min_us:
            gaps.append((gap, end, e["ts"]))
        elif gap > 0:
            small += gap
        end = max(end, e["ts"] + e["dur"])
    large = sum(g for g, _, _ in gaps)
    gaps.sort(reverse=True)
    return {"step_ms_profiled": round(step["dur"] / 1e3, 1), "gpu_busy_ms": round(sum(kinds.values()), 1),
            "by_kind_ms": {k: round(v, 1) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "idle_ms": round((large + small) / 1e3, 2), "idle_in_gaps_over_min_ms": round(large / 1e3, 2),
            "min_gap_us": min_us,
            "largest_gaps": [{"at_ms": round((a - t0) / 1e3, 2), "gap_ms": round(g / 1e3, 3), "host": host_at((a + b) / 2)}
                             for g, a, b in gaps[:12]]}


def head_parity(engine, samples, dev: str) -> dict:
    """The trainer's fused head vs services.common.tensors.modeling.response_logprobs on 2 x 512 tokens: values and
    gradients (run on a variant without compile: the 512-token shape would compile again)."""
    rank = engine.rank
    model = rank.actor.module
    n = min(511, len(samples[0].response_ids))
    ps = [s.prompt_ids for s in samples[:2]]
    rs = [s.response_ids[:n] for s in samples[:2]]
    adv = torch.randn(2, n, generator=torch.Generator().manual_seed(3)).to(dev)
    watch = {"lm_head": model.lm_head.weight, "layer0_down_proj": model.model.layers[0].mlp.down_proj.weight}
    paths = {"reference": lambda: response_logprobs(model, ps, rs, pad_id=rank.pad_id, with_entropy=True),
             "fused": lambda: fused.fused_response_logprobs(model, ps, rs, pad_id=rank.pad_id, device=rank.device)}
    out = {}
    for name, fn in paths.items():
        model.zero_grad(set_to_none=True)
        with rank.layout.amp():
            logp, mask, ent = fn()
        ((logp * adv).sum() + 0.1 * ent.sum()).backward()
        out[name] = (logp.detach().float(), ent.detach().float(), {k: w.grad.detach().float().clone()
                                                                   for k, w in watch.items()})
    model.zero_grad(set_to_none=True)
    (lr, er, gr), (lf, ef, gf) = out["reference"], out["fused"]
    res = {"logp_max_abs_diff": float((lr - lf).abs().max()), "entropy_max_abs_diff": float((er - ef).abs().max())}
    for k in gr:
        res[f"grad_rel_diff_{k}"] = float((gr[k] - gf[k]).norm() / gr[k].norm().clamp(min=1e-30))
    return res


def matmul_ceiling(dev: str) -> float | None:
    if not dev.startswith("cuda"):
        return None
    n = 8192
    a, b = torch.randn(n, n, device=dev, dtype=torch.bfloat16), torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * 20 / (start.elapsed_time(end) / 1e3)


def free(dev: str) -> None:
    gc.collect()
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


VARIANTS = {
    # name: (kind, amp, actor overrides); no override = the trainer's defaults for the device
    "plain": ("plain", False, {}),
    "engine": ("engine", False, {}),
    "engine_amp": ("engine", True, {}),
    "engine_bf16": ("engine", False, {"param_dtype": "bfloat16"}),
    "engine_eager": ("engine", False, {"compile": False}),
    "engine_unfused": ("engine", False, {"compile": False, "fused_logprobs": False}),
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny model, short sequences (CPU smoke test)")
    parser.add_argument("--sizes", default="0.5b,1.5b")
    parser.add_argument("--variants", default="plain,engine,engine_amp,engine_eager,engine_unfused")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--budget", type=int, default=16384, help="actor.micro_batch_token_budget")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "trainer_mfu.json"))
    parser.add_argument("--merge", action="store_true", help="add to the variants already in --out")
    parser.add_argument("--actor", type=json.loads, default={},
                        help='actor settings for every engine variant, under its own (JSON, e.g. \'{"fused_logprobs": true}\')')
    parser.add_argument("--profile", type=lambda v: v.split(","), default=[],
                        help="variants to profile one extra step of (device time by kernel kind, GPU idle gaps)")
    parser.add_argument("--trace-dir", default=None, help="also write each profiled step's Chrome trace here")
    parser.add_argument("--analyze-trace", default=None, help="print trace_profile of a saved trace and exit")
    args = parser.parse_args(argv)
    if args.analyze_trace:
        print(json.dumps(trace_profile(args.analyze_trace), indent=2))
        return
    dev = args.device
    sizes = ["tiny"] if args.tiny else args.sizes.split(",")
    variants = args.variants.split(",")
    dtype_name = "bfloat16" if dev.startswith("cuda") else "float32"
    dtype = getattr(torch, dtype_name)
    ceiling = matmul_ceiling(dev)
    print(f"bf16 8192^3 matmul: {ceiling / 1e12:.0f} TFLOP/s" if ceiling else "no GPU ceiling", flush=True)
    out_path = Path(args.out)
    previous = json.loads(out_path.read_text()) if args.merge and out_path.exists() else {}
    results = {e["size"]: e for e in previous.get("results", [])}
    out = {"benchmark": "trainer_mfu", "device": torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu",
           "peak_flops_bf16": PEAK_BF16, "measured_bf16_matmul_flops": ceiling,
           "flops_formula": "6*N*tokens + 12*layers*hidden*seq*tokens (N with the tied embedding once)",
           "torch": torch.__version__, "transformers": __import__("transformers").__version__,
           "triton": getattr(fused.triton, "__version__", None), "python": platform.python_version(),
           "sequences": "1 prompt token + (seq-1) response tokens; one optimizer step per call",
           "results": []}

    def write() -> None:
        for e in results.values():
            plain = e["variants"].get("plain", {}).get("tokens_per_s")
            for r in e["variants"].values():
                if plain and "tokens_per_s" in r:
                    r["vs_plain"] = round(r["tokens_per_s"] / plain, 3)
        out["results"] = list(results.values())
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(out, indent=2) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            shape = SHAPES[size]
            path = Path(tmp) / size
            num_params = save_model(shape, path, dev)
            free(dev)
            samples = make_samples(args.batch, args.seq, shape["vocab_size"])
            t0 = time.perf_counter()
            validate_actor_batch(samples, ActorLoss(), vocab_size=shape["vocab_size"], max_len=4096)
            validate_s = time.perf_counter() - t0
            flops = model_flops_per_step(shape, num_params, args.batch, args.seq)
            entry = results.setdefault(size, {"size": size, "variants": {}})
            for note in ("remeasured", "measured_in"):  # notes about an earlier call of a merged file
                entry.pop(note, None)
            entry.update({"size": size, "shape": shape, "num_parameters": num_params, "batch": args.batch,
                          "seq": args.seq, "tokens_per_step": args.batch * args.seq, "model_flops_per_step": flops,
                          "validate_actor_batch_seconds": round(validate_s, 4), "variants": entry["variants"]})
            for name in variants:
                kind, amp, overrides = VARIANTS[name]
                t_variant = time.perf_counter()
                try:
                    if kind == "plain":
                        r = run_plain(str(path), samples, dev, args.warmup, args.steps, dtype)
                    else:
                        r = run_engine(str(path), samples, dev, args.warmup, args.steps, amp=amp, overrides={**args.actor, **overrides},
                                       dtype=dtype_name, budget=args.budget, parity=(name == "engine_eager"),
                                       profile=name in args.profile,
                                       trace=(str(Path(args.trace_dir) / f"trace_{size}_{name}.json")
                                              if args.trace_dir else None))
                except Exception as e:  # noqa: BLE001 - an OOM in one variant must not lose the others
                    traceback.print_exc()
                    r = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                if "times" in r:
                    t = statistics.median(r["times"])
                    r.update(step_seconds=round(t, 4), tokens_per_s=round(args.batch * args.seq / t, 1),
                             tflops=round(flops / t / 1e12, 1), mfu=round(flops / t / PEAK_BF16, 4),
                             times=[round(x, 4) for x in r["times"]])
                    if ceiling:
                        r["mfu_vs_measured_matmul"] = round(flops / t / ceiling, 4)
                    if dev.startswith("cuda"):
                        r["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
                r["wall_seconds_incl_load"] = round(time.perf_counter() - t_variant, 1)
                entry["variants"][name] = r
                print(size, name, json.dumps({k: v for k, v in r.items() if k != "times"}), flush=True)
                free(dev)
                write()
            shutil_rm(path)

    write()
    print("\nsize  variant                   tok/s      MFU   vs plain")
    for e in results.values():
        for name, r in e["variants"].items():
            if "tokens_per_s" in r:
                print(f"{e['size']:5s} {name:24s} {r['tokens_per_s']:9.0f}  {r['mfu']:6.3f}  {r.get('vs_plain', 0):.3f}")
            else:
                print(f"{e['size']:5s} {name:24s} {r.get('error')}")
    print(f"wrote {args.out}")


def shutil_rm(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
