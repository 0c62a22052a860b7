"""Generation throughput on one GPU: the rollout torch engine (CUDA-graph decode and eager loop) vs `model.generate`.

A Qwen2.5-0.5B-shaped model with random weights in bf16; random prompts of --prompt-len tokens;
--new-tokens new tokens per row (temperature 1, top_p 1, top_k off); one sample per prompt.
Measured in one process, on the same prompts:

  engine_cuda_graphs   TorchEngine with rollout.cuda_graphs (services/rollout/engine_torch/cuda_decode.py: decode step
                       compiled, then captured), median of --repeats calls after a first call that
                       compiles and captures (reported apart)
  engine_cuda_graphs_nocompile   the same with rollout.cuda_graph_compile off (eager kernels captured)
  engine_eager         TorchEngine's own DynamicCache loop (one call after a short warm-up)
  generate             model.generate(do_sample=True) with the default DynamicCache
  generate_static      model.generate(cache_implementation="static"), which transformers compiles;
                       the warm-up call (the compile) is reported apart

The engine also returns the raw log-prob of each sampled token; generate here does not (asking
it for output_logits would keep [B, T, V] fp32 logits: 40 GB at batch 256), so the baselines do
less work than the engine. Tokens counted: generated ones up to and including eos (a random model
practically never samples eos, so rows run the full --new-tokens). Finally the engine's sampled
log-probs are compared with a full forward pass (services.common.tensors.modeling.response_logprobs).

    PYTHONPATH=.:protos python bench/rollout_gpu.py [--batches 64,256] [--out bench/results/rollout_throughput_gpu.json]
    PYTHONPATH=.:protos python bench/rollout_gpu.py --device cpu --tiny     # smoke test of the script
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from services.common.tensors.modeling import response_logprobs  # noqa: E402
from services.rollout.config import RolloutSettings  # noqa: E402
from services.rollout.engine_torch.engine import TorchEngine  # noqa: E402
from services.rollout.types import GenerateBatch, PromptInput, SamplingParams  # noqa: E402

QWEN25_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6,
                  max_position_embeddings=32768, rope_theta=1000000.0)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=512, tie_word_embeddings=True, max_position_embeddings=1024)
EOS, PAD = 151645, 151643


def build_model(shape: dict, device: str, dtype: torch.dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    eos, pad = (EOS, PAD) if shape["vocab_size"] > EOS else (2, 0)
    cfg = Qwen2Config(**shape, bos_token_id=pad, eos_token_id=eos, pad_token_id=pad)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(dtype)
    model.eval().requires_grad_(False)
    model.generation_config.pad_token_id = pad
    model.generation_config.eos_token_id = eos
    return model


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def engine_fn(engine: TorchEngine, prompts: list[list[int]], new_tokens: int):
    batch = GenerateBatch([PromptInput(id=str(i), prompt_ids=p) for i, p in enumerate(prompts)],
                          SamplingParams(n=1, temperature=1.0, top_p=1.0, max_tokens=new_tokens))

    def run():
        results = engine.generate_sync(batch)
        return [s for r in results for s in r.samples]

    return run


def count(samples) -> int:
    return sum(len(s.response_ids) for s in samples)


@torch.inference_mode()
def generate_fn(model, ids: torch.Tensor, new_tokens: int, **extra):
    mask = torch.ones_like(ids)
    eos = model.generation_config.eos_token_id

    def run():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                             max_new_tokens=new_tokens, min_new_tokens=0, **extra)
        new = out[:, ids.shape[1]:]
        is_eos = (new == eos).int()
        after = (is_eos.cumsum(-1) - is_eos) > 0          # tokens after the first eos are padding
        return int((~after).sum())

    return run


def logprob_parity(model, pad_id: int, prompts, samples, rows: int) -> dict:
    """Engine log-probs vs a full forward pass over prompt + response (in chunks of 8 rows)."""
    diffs = []
    for start in range(0, rows, 8):
        ps = prompts[start:min(start + 8, rows)]
        ss = samples[start:start + len(ps)]
        with torch.inference_mode():
            ref, _ = response_logprobs(model, ps, [s.response_ids for s in ss], pad_id=pad_id)
        for i, s in enumerate(ss):
            diffs.append((ref[i, :len(s.logprobs)].cpu().double() - torch.tensor(s.logprobs, dtype=torch.float64)).abs())
    d = torch.cat(diffs)
    return {"rows": rows, "tokens": d.numel(), "max_abs_diff": round(float(d.max()), 5),
            "mean_abs_diff": round(float(d.mean()), 6), "p99_abs_diff": round(float(d.quantile(0.99)), 5)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny model and shapes (CPU smoke test)")
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip", default="", help="comma list of methods to leave out")
    parser.add_argument("--parity-rows", type=int, default=16)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "rollout_throughput_gpu.json"))
    parser.add_argument("--merge", action="store_true", help="keep methods already in --out that this run skips")
    parser.add_argument("--static-batches", type=lambda v: [int(b) for b in v.split(",")], default=None,
                        help="batch sizes that run generate_static (default: all; each one compiles)")
    args = parser.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    dev = args.device
    shape = TINY if args.tiny else QWEN25_05B
    dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    model = build_model(shape, dev, dtype)
    pad_id = model.config.pad_token_id
    batches = [int(b) for b in args.batches.split(",")]
    settings = lambda graphs, compile=True: RolloutSettings(  # noqa: E731
        model={"path": "random-init", "device": dev, "dtype": "bfloat16" if dtype == torch.bfloat16 else "float32"},
        rollout={"max_batch_size": max(batches), "cuda_graphs": graphs, "cuda_graph_compile": compile,
                 "kv_cache": "none"})   # the unpaged decoder, eager or graphs (auto is the paged cache on CUDA)
    engines = {"engine_eager": TorchEngine(settings(False), model=model, tokenizer=None)}
    if dev.startswith("cuda") and "engine_cuda_graphs" not in skip:
        engines["engine_cuda_graphs"] = TorchEngine(settings(True), model=model, tokenizer=None)
    if dev.startswith("cuda") and "engine_cuda_graphs_nocompile" not in skip:
        engines["engine_cuda_graphs_nocompile"] = TorchEngine(settings(True, False), model=model, tokenizer=None)
    elif args.tiny and "engine_cuda_graphs" not in skip:
        # CPU smoke test of the graph decoder's step, run eagerly (no graphs on CPU).
        from services.rollout.engine_torch.cuda_decode import GraphDecoder
        e = engines["engine_cuda_graphs"] = TorchEngine(settings(False), model=model, tokenizer=None)
        e._graph_decoder = GraphDecoder(model, pad_id=pad_id, eos_ids=sorted(e.eos_ids), max_batch_size=max(batches),
                                        use_graphs=False)
    g = torch.Generator().manual_seed(1)
    vocab = shape["vocab_size"] - 2 if shape["vocab_size"] < PAD else PAD
    out_path = Path(args.out)
    previous = json.loads(out_path.read_text()) if args.merge and out_path.exists() else {}
    old_rows = {r["batch"]: r for r in previous.get("workloads", [])}
    parity = previous.get("logprob_parity_vs_full_forward", {})
    rows = []

    def write(rows_now, parity_now) -> None:
        keep = [r for b, r in old_rows.items() if b not in {x["batch"] for x in rows_now}]
        result = _result(args, shape, dtype, model, dev, engines, parity_now, sorted(keep + rows_now,
                                                                                  key=lambda r: r["batch"]))
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=2) + "\n")

    for B in batches:
        prompts = torch.randint(0, vocab, (B, args.prompt_len), generator=g).tolist()
        ids = torch.tensor(prompts, device=dev)
        row = dict(old_rows.get(B, {}), batch=B, prompt_len=args.prompt_len, new_tokens=args.new_tokens)
        for name in ("engine_cuda_graphs", "engine_cuda_graphs_nocompile"):
            if name not in engines:
                continue
            run = engine_fn(engines[name], prompts, args.new_tokens)
            first, samples = timed(run, dev)
            times = []
            for _ in range(args.repeats):
                t, samples = timed(run, dev)
                times.append(t)
            t = statistics.median(times)
            row[name] = {"tokens": count(samples), "seconds": round(t, 4), "tokens_per_s": round(count(samples) / t, 1),
                         "first_call_seconds": round(first, 3), "all_seconds": [round(x, 4) for x in times]}
            parity[f"{name}_batch{B}"] = logprob_parity(model, pad_id, prompts, samples, min(args.parity_rows, B))
            write(rows + [row], parity)
        if "engine_eager" not in skip:
            engine_fn(engines["engine_eager"], prompts, 4)()                 # warm-up
            t, samples = timed(engine_fn(engines["engine_eager"], prompts, args.new_tokens), dev)
            row["engine_eager"] = {"tokens": count(samples), "seconds": round(t, 3),
                                   "tokens_per_s": round(count(samples) / t, 1)}
            if B == batches[0]:
                parity[f"engine_eager_batch{B}"] = logprob_parity(model, pad_id, prompts, samples,
                                                                  min(args.parity_rows, B))
        if "generate" not in skip:
            generate_fn(model, ids, 4)()                                       # warm-up
            t, n = timed(generate_fn(model, ids, args.new_tokens), dev)
            row["generate"] = {"tokens": n, "seconds": round(t, 3), "tokens_per_s": round(n / t, 1)}
        if "generate_static" not in skip and dev.startswith("cuda") and (not args.static_batches
                                                                         or B in args.static_batches):
            fn = generate_fn(model, ids, args.new_tokens, cache_implementation="static")
            first, _ = timed(fn, dev)                                           # compiles
            t, n = timed(fn, dev)
            row["generate_static"] = {"tokens": n, "seconds": round(t, 3), "tokens_per_s": round(n / t, 1),
                                      "first_call_seconds": round(first, 2)}
        for base in ("generate", "generate_static", "engine_eager", "engine_cuda_graphs_nocompile"):
            if base in row and "engine_cuda_graphs" in row:
                row[f"cuda_graphs_vs_{base}"] = round(row["engine_cuda_graphs"]["tokens_per_s"]
                                                      / row[base]["tokens_per_s"], 2)
        rows.append(row)
        write(rows, parity)
        print(json.dumps(row), flush=True)
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
    print(json.dumps(parity))
    print(f"wrote {args.out}")


def _result(args, shape, dtype, model, dev, engines, parity, rows) -> dict:
    gd = getattr(engines.get("engine_cuda_graphs"), "_graph_decoder", None)
    return {
        "benchmark": "rollout_throughput_gpu",
        "model": "Qwen2.5-0.5B shape (random init)" if not args.tiny else "tiny random Qwen2",
        "shape": shape, "dtype": str(dtype), "num_parameters": sum(p.numel() for p in model.parameters()),
        "device": torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu",
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "python": platform.python_version(),
        "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "n": 1},
        "notes": "engine returns raw fp32 log-probs of sampled tokens; generate baselines return tokens only",
        "graph_decoder_stats": gd.stats if gd is not None else None,
        "logprob_parity_vs_full_forward": parity,
        "workloads": rows,
    }


if __name__ == "__main__":
    main()
