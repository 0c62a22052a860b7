"""Remove padding and the fused chunked LM head, measured: packed vs padded tokens/s on a long-tailed length
spread, and peak memory of an actor step and a log-prob pass with the fused head vs full logits.

  spread   a GRPO-like batch whose prompts are 64-512 tokens and responses long-tailed from 32 to 2,048
           (log-uniform: most are short, a few are long), one TrainActor step (one optimizer step) and one
           ComputeLogProbs pass per variant: actor.use_remove_padding true (packed rows filled to the token
           budget) vs false (right-padded rows, batch * longest within the budget). tokens/s counts real
           tokens (prompt + response), so padding is never counted as work.
  memory   8 sequences of 4,096 tokens (64 prompt + 4,032 response) on a Qwen2.5-1.5B-shaped model (vocab
           151,936): peak device memory over the memory the trainer holds before the call (weights, AdamW
           state), of one TrainActor step and of one ComputeLogProbs pass, actor.fused_logprobs true (chunked
           head: no fp32 [tokens, vocab]) vs false (the model's full logits). Activation checkpointing is on,
           so the head's share is what differs.

Both variants of each pair run in the same process and run (the baseline beside the new path). On CPU
(`--device cpu --tiny`) the shapes shrink and memory is the process's peak RSS growth in a subprocess per
variant: a smoke check that runs in the tests.

    PYTHONPATH=.:protos python bench/trainer_packing.py --size 1.5b --out bench/results/trainer_packing.json
    PYTHONPATH=.:protos python bench/trainer_packing.py --device cpu --tiny --out bench/results/trainer_packing_cpu.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402

from trainer_mfu import SHAPES, save_model, sync  # noqa: E402

from services.common.config import load_config  # noqa: E402
from services.trainer.types import ActorLoss, TrainSample  # noqa: E402

# Prompt and response ranges, samples and token budget of the spread; batch x length of the memory part and the
# vocabulary of its model (tiny: large enough that [tokens, vocab] fp32 outgrows the head's 256 MB chunk).
SCALES = {"full": dict(prompt=(64, 512), response=(32, 2048), samples=64, budget=16384, mem=(8, 4096),
                       mem_vocab=None),
          "tiny": dict(prompt=(4, 32), response=(2, 128), samples=24, budget=512, mem=(4, 1024), mem_vocab=32768)}


def spread_samples(n: int, prompt: tuple[int, int], response: tuple[int, int], vocab: int,
                   seed: int = 0) -> list[TrainSample]:
    """Prompts uniform in `prompt`, responses log-uniform in `response` (a long tail), random advantages."""
    g = torch.Generator().manual_seed(seed)
    out = []
    lo, hi = math.log(response[0]), math.log(response[1])
    for _ in range(n):
        p = int(torch.randint(prompt[0], prompt[1] + 1, (1,), generator=g))
        r = int(round(math.exp(lo + (hi - lo) * float(torch.rand(1, generator=g)))))
        ids = torch.randint(3, vocab, (p + r,), generator=g).tolist()
        out.append(TrainSample(prompt_ids=ids[:p], response_ids=ids[p:], advantages=torch.randn(r, generator=g).tolist(),
                               old_logprobs=[-math.log(vocab)] * r))
    return out


def build(path: str, dev: str, actor: dict):
    from services.trainer.config import TrainerSettings
    from services.trainer.engine import TrainerEngine

    dtype = "bfloat16" if dev.startswith("cuda") else "float32"
    return TrainerEngine(load_config(TrainerSettings, data={
        "model": {"path": path, "dtype": dtype, "device": dev}, "actor": {"lr": 1e-6, **actor}}))


def timed(fn, dev: str, warmup: int, steps: int) -> float:
    """Median seconds of fn over `steps` calls after `warmup`."""
    for _ in range(warmup):
        fn()
    sync(dev)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def plain_groups(lengths, budget: int) -> list[list[int]]:
    """A plain trainer's micro-batches: a fixed number of rows in the batch's order (as many of the longest row as
    the token budget holds), each padded to its own longest row."""
    rows = max(1, budget // max(lengths))
    return [list(range(i, min(i + rows, len(lengths)))) for i in range(0, len(lengths), rows)]


# name: (actor.use_remove_padding, padded grouping, actor.compile)
SPREAD_VARIANTS = {"padded": (False, "sorted", False), "padded_longest": (False, "plain", False),
                   "packed": (True, "sorted", False), "padded_compiled": (False, "sorted", True),
                   "packed_compiled": (True, "sorted", True)}


def slots(lengths, budget: int, packed: bool, grouping: str) -> int:
    """Token slots the variant's forwards compute (real tokens plus padding)."""
    from services.common.tensors.modeling import pack_by_token_budget
    from services.common.tensors.packing import pack_by_token_sum

    if packed:
        return sum(lengths)
    groups = (plain_groups if grouping == "plain" else pack_by_token_budget)(lengths, budget)
    return sum(len(g) * max(lengths[i] for i in g) for g in groups)


def print_profile(name: str, fn) -> None:
    """One more call under torch.profiler: its top kernels and host ops by device time, to the log."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync("cuda")
    print(f"== profile {name}\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=30,
                                                             max_name_column_width=70), flush=True)


def run_spread(path: str, dev: str, scale: dict, vocab: int, *, warmup: int, steps: int, variants: list[str]) -> dict:
    from services.trainer.parallel import layout as layout_mod

    samples = spread_samples(scale["samples"], scale["prompt"], scale["response"], vocab)
    prompts, responses = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
    tokens = sum(len(p) + len(r) for p, r in zip(prompts, responses))
    lengths = sorted(len(p) + len(r) for p, r in zip(prompts, responses))
    order_lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    out = {"samples": len(samples), "tokens": tokens, "micro_batch_token_budget": scale["budget"],
           "length_min": lengths[0], "length_median": lengths[len(lengths) // 2], "length_max": lengths[-1],
           "variants_note": "padded: right-padded rows grouped by length (sorted, batch * longest within the budget: "
                            "the trainer's padded path); padded_longest: a plain trainer's micro-batches (a fixed "
                            "row count in batch order, each padded to its longest row); packed: "
                            "actor.use_remove_padding (one packed row per micro-batch filled to the budget); "
                            "*_compiled: actor.compile on (the CUDA default), else eager"}
    original = layout_mod.pack_by_token_budget
    for name in variants:
        packed, grouping, compile = SPREAD_VARIANTS[name]
        layout_mod.pack_by_token_budget = plain_groups if grouping == "plain" else original
        try:
            engine = build(path, dev, {"use_remove_padding": packed, "micro_batch_token_budget": scale["budget"],
                                       "compile": compile})
            step_s = timed(lambda: engine.train_actor(samples, ActorLoss()), dev, warmup, steps)
            lp_s = timed(lambda: engine.compute_logprobs(prompts, responses), dev, warmup, steps)
            if os.environ.get("PACK_PROFILE") and dev.startswith("cuda"):
                print_profile(name, lambda: engine.train_actor(samples, ActorLoss()))
            out[name] = {"actor_step_s": step_s, "actor_tokens_per_s": tokens / step_s, "logprobs_s": lp_s,
                         "logprobs_tokens_per_s": tokens / lp_s, "fused_logprobs": engine.rank.fused_logprobs,
                         "token_slots": slots(order_lengths, scale["budget"], packed, grouping)}
            engine.close()
            del engine
        except Exception as e:  # noqa: BLE001 - one variant failing must not lose the others
            out[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        finally:
            layout_mod.pack_by_token_budget = original
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
        print(name, json.dumps(out[name]), flush=True)
    # packed_over_padded_actor / _logprobs: against the trainer's padded path, as before; the others say theirs.
    for new, ref, suffix in (("packed", "padded", ""), ("packed", "padded_longest", "_vs_padded_longest"),
                             ("packed_compiled", "padded_compiled", "_compiled")):
        a, b = out.get(new, {}), out.get(ref, {})
        if "actor_tokens_per_s" in a and "actor_tokens_per_s" in b:
            out[f"packed_over_padded_actor{suffix}"] = a["actor_tokens_per_s"] / b["actor_tokens_per_s"]
            out[f"packed_over_padded_logprobs{suffix}"] = a["logprobs_tokens_per_s"] / b["logprobs_tokens_per_s"]
    return out


def memory_variant(path: str, dev: str, scale: dict, vocab: int, fused: bool, what: str,
                   budget: int | None = None) -> dict:
    """Peak memory of one call (`actor` step or `logprobs` pass) beyond what the trainer held before it; the
    micro-batch token budget is the whole batch (one forward) unless `budget` says otherwise."""
    batch, length = scale["mem"]
    samples = spread_samples(batch, (64, 64), (length - 64, length - 64), vocab)
    engine = build(path, dev, {"fused_logprobs": fused, "activation_checkpointing": "full",
                               "micro_batch_token_budget": budget or batch * length, "compile": False})
    prompts, responses = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
    call = (lambda: engine.train_actor(samples, ActorLoss())) if what == "actor" else \
        (lambda: engine.compute_logprobs(prompts, responses))
    if what == "actor" and dev.startswith("cuda"):
        call()                             # AdamW state exists from the first step on: count it as held
    # (On CPU the peak RSS only grows, so a first step would hide the second: the step's extra includes
    # AdamW's state there, the same for both variants.)
    if dev.startswith("cuda"):
        sync(dev)
        torch.cuda.empty_cache()
        held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        try:
            call()
        except torch.OutOfMemoryError:
            return {"oom": True, "held_gb": held / 1e9}
        sync(dev)
        return {"held_gb": held / 1e9, "peak_gb": torch.cuda.max_memory_allocated() / 1e9,
                "extra_gb": (torch.cuda.max_memory_allocated() - held) / 1e9}
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    call()
    return {"extra_gb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024 / 1e9}


def run_memory(path: str, dev: str, tiny: bool) -> dict:
    """Each variant in its own process: peak figures never mix."""
    batch, length = SCALES["tiny" if tiny else "full"]["mem"]
    half = batch * length // 2
    out = {"batch": batch, "length": length,
           "note": f"each variant runs the whole batch as one forward (micro_batch_token_budget {batch * length}) "
                   f"except logprobs_fused_budget{half}: two forwards of {half} tokens (16,384 is the trainer's "
                   "default budget). Activation checkpointing full; on CUDA fp32 master weights with bf16 autocast "
                   "(the trainer's default for a bf16 model); extra = peak - memory held before the call (weights, "
                   "AdamW state)"}
    for what, fused, budget in (("actor", False, None), ("actor", True, None), ("logprobs", False, None),
                                ("logprobs", True, None), ("logprobs", True, half)):
        key = f"{what}_{'fused' if fused else 'full_logits'}" + (f"_budget{budget}" if budget else "")
        cmd = [sys.executable, __file__, "--device", dev, "--memory-variant",
               f"{what},{int(fused)},{budget or 0}", "--model", path] + (["--tiny"] if tiny else [])
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        print(key, done.stdout[-300:], flush=True)
        lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
        out[key] = json.loads(lines[-1]) if lines else {"error": done.stderr[-2000:]}
    for what in ("actor", "logprobs"):
        full, fused = out[f"{what}_full_logits"].get("extra_gb"), out[f"{what}_fused"].get("extra_gb")
        if full and fused:
            out[f"{what}_extra_saved_gb"] = full - fused
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", default="1.5b", choices=[k for k in SHAPES if k != "tiny"])
    ap.add_argument("--tiny", action="store_true", help="tiny model and shapes (a CPU smoke check)")
    ap.add_argument("--parts", default="spread,memory")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--variants", default="padded,padded_longest,packed",
                    help=f"spread variants, of {','.join(SPREAD_VARIANTS)}")
    ap.add_argument("--out", default=None)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--memory-variant", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    shape = SHAPES["tiny" if args.tiny else args.size]
    scale = SCALES["tiny" if args.tiny else "full"]
    torch.set_num_threads(min(8, os.cpu_count() or 1))
    if args.memory_variant:
        what, fused, budget = (args.memory_variant.split(",") + ["0"])[:3]
        vocab = scale["mem_vocab"] or shape["vocab_size"]
        print(json.dumps(memory_variant(args.model, args.device, scale, vocab, fused == "1", what, int(budget) or None)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        num_params = save_model(shape, Path(tmp) / "model", "cpu")
        path = str(Path(tmp) / "model")
        mem_path = path
        if scale["mem_vocab"]:
            mem_path = str(Path(tmp) / "mem_model")
            save_model({**shape, "vocab_size": scale["mem_vocab"]}, Path(mem_path), "cpu")
        result = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                  "model": "tiny" if args.tiny else f"qwen2.5-{args.size}-shaped", "num_params": num_params,
                  "torch": torch.__version__}
        parts = args.parts.split(",")
        if "spread" in parts:
            result["spread"] = run_spread(path, args.device, scale, shape["vocab_size"], warmup=args.warmup,
                                          steps=args.steps, variants=args.variants.split(","))
            print(json.dumps(result["spread"], indent=1), flush=True)
            write(args.out, result)               # each part as it finishes: a time limit keeps what ran
        if "memory" in parts:
            result["memory"] = run_memory(mem_path, args.device, args.tiny)
            print(json.dumps(result["memory"], indent=1), flush=True)
            write(args.out, result)


def write(out: str | None, result: dict) -> None:
    if not out:
        return
    from bench import provenance

    stem = Path(out).stem
    if stem in provenance.SOURCES:
        provenance.stamp(stem, result)
    Path(out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
