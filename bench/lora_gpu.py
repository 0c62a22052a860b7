"""LoRA on the GPU at the Qwen2.5-1.5B shape, rank 16 on every projection, in parts that each fill one section of
bench/results/lora_gpu.json (a part left out keeps the section it had):

- `sync`: weight sync per step, the adapter alone vs the full weights, over grpc (loopback) and ipc, in the same run:
  a spawned process runs the real rollout server (servicer, receivers, TorchEngine with rollout.enable_lora) around
  a 1.5B-shaped bf16 model; this process pushes with the trainer's own senders (services/trainer/weights/), full
  weights first (tagged with a base id, which the replica then holds), then the adapter (its name, config and that
  base id), each timed from the call to the replica's version reply. The adapter's bytes are PEFT's lora_A/lora_B
  in bf16, as the trainer sends them (weight_sync dtype = the model's).
- `decode`: the torch engine's decode tokens/s (CUDA graphs, as `auto` resolves) with rows of 4 adapters in one
  batch vs every row on 1 adapter vs the base model (adapter ""), on the same LoRA engine, and the base on an engine
  without LoRA (the cost of the adapter GEMMs on base rows); then, as `torch_ops`, 4 adapters and the base on a LoRA
  engine whose decode step applies adapters with torch ops (mask, expand GEMM, add) instead of the one
  `meshrl::lora_expand` kernel per group (engine_torch/lora_expand.py): the same-call baseline of that kernel.
A later part (the LoRA train step) adds itself to PARTS.

    PYTHONPATH=.:protos python bench/lora_gpu.py --parts sync,decode [--out bench/results/lora_gpu.json]
    PYTHONPATH=.:protos python bench/lora_gpu.py --tiny --device cpu --parts sync,decode --out /tmp/lora.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "protos"), str(REPO / "bench")]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

SHAPES = {
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512, tie_word_embeddings=True, max_position_embeddings=1024),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BASE_ID = "bench-base"
MIB = 2**20


def build_model(size: str, device: str, dtype: torch.dtype, seed: int = 0):
    """A Qwen2 of that shape with random weights and no eos (every row decodes its whole budget)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPES[size], eos_token_id=None, pad_token_id=0)).to(dtype)
    return model.eval().requires_grad_(False)


def lora_settings(size: str, device: str, dtype: str, *, lora: bool, rank: int, max_loras: int, max_batch: int = 0,
                  kv_cache: str = "none"):
    """The replica's settings. kv_cache: none (the unpaged CUDA-graph decoder every earlier call measured; auto has
    been the paged cache on CUDA since 235906e), paged or auto."""
    from services.rollout.config import RolloutSettings

    rollout = {"enable_lora": lora, "max_loras": max_loras, "max_lora_rank": rank, "lora_target_modules": TARGETS,
               "kv_cache": kv_cache}
    if max_batch:
        rollout["max_batch_size"] = max_batch
    return RolloutSettings(model={"path": f"bench-qwen2-{size}", "dtype": dtype, "device": device},
                           rollout=rollout, server={"max_message_bytes": 64 * MIB})


def adapter_tensors(model, rank: int, dtype: torch.dtype, device: str, seed: int) -> dict[str, torch.Tensor]:
    """Random lora_A / lora_B of every target projection under PEFT's saved names."""
    from services.rollout.engine_torch.lora import adapter_targets

    g = torch.Generator(device="cpu").manual_seed(seed)
    out = {}
    for path, m in adapter_targets(model, TARGETS).items():
        out[f"base_model.model.{path}.lora_A.weight"] = (torch.randn(rank, m.in_features, generator=g) * 0.01)
        out[f"base_model.model.{path}.lora_B.weight"] = (torch.randn(m.out_features, rank, generator=g) * 0.01)
    return {k: v.to(device=device, dtype=dtype) for k, v in out.items()}


def adapter_config(rank: int) -> dict:
    return {"r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS}


def nbytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


# --------------------------------------------------------------------------------------------------
# sync: a real replica in its own process


def replica_proc(conn, size: str, device: str, rank: int) -> None:
    sys.path[:0] = [str(REPO), str(REPO / "protos")]
    from services.rollout.engine_torch.engine import TorchEngine
    from services.rollout.servicer import start

    torch.set_num_threads(1)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    settings = lora_settings(size, device, dtype, lora=True, rank=rank, max_loras=1, max_batch=8)
    settings.rollout.warmup = False
    engine = TorchEngine(settings, model=build_model(size, device, getattr(torch, dtype)), tokenizer=False)

    async def main():
        mesh, port, replica = await start(settings, "127.0.0.1:0", engine=engine)
        conn.send(port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        threading.Thread(target=lambda: (conn.recv(), loop.call_soon_threadsafe(stop.set)), daemon=True).start()
        await stop.wait()
        await mesh.stop(0)
        await replica.close()

    asyncio.run(main())


def push_seconds(sender, state, target: str, repeats: int, bucket_bytes: int, tags, first_version: int):
    """Seconds of each push (the first one apart: handles opened, buffers staged) and the replica's share of each
    (UpdateWeightsResponse.seconds: received, checked, loaded), and the next version."""
    replica = []

    async def main():
        out = []
        for i in range(repeats + 1):
            for t in state.values():             # new weights every round: the trainer just stepped
                t.mul_(1.0001 if i % 2 else 0.9999)
            t0 = time.perf_counter()
            outcome = (await sender.push(state, first_version + i, [target], bucket_bytes=bucket_bytes,
                                         tags=tags))[0]
            out.append(time.perf_counter() - t0)
            replica.append(outcome.replica_seconds)
            if not outcome.ok:
                raise RuntimeError(f"{sender.transport} push failed: {outcome.error}")
        return out

    return asyncio.run(main()), replica, first_version + repeats + 1


def run_sync(args) -> dict:
    """Full weights vs the adapter per push, per transport (module docstring)."""
    from services.common.tensors.weights import named_weights
    from services.trainer.weights.choice import build_sender
    from services.trainer.weights.senders import ManifestTags

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=replica_proc, args=(child, args.size, args.device, args.rank), daemon=True)
    proc.start()
    if not parent.poll(600):
        raise RuntimeError("replica did not start")
    target = f"127.0.0.1:{parent.recv()}"
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build_model(args.size, "cpu" if not cuda else args.device, dtype, seed=1)
    transports = ["grpc", "ipc"] if cuda else ["grpc"]
    rows, version = [], 1
    try:
        for transport in transports:
            where = args.device if transport != "grpc" else "cpu"
            full = {n: p.detach().to(where, copy=True) for n, p in named_weights(model).items()}
            adapter = adapter_tensors(model, args.rank, dtype, where, seed=2)
            sender = build_sender(transport, token=None, timeout=600.0)
            bucket = (4 if transport == "grpc" else 128) * MIB
            row = {"transport": transport, "full_bytes": nbytes(full), "adapter_bytes": nbytes(adapter),
                   "repeats": args.repeats}
            full_s, full_replica, version = push_seconds(sender, full, target, args.repeats, bucket,
                                                         ManifestTags(base_id=BASE_ID), version)
            tags = ManifestTags(adapter="default", adapter_config=json.dumps(adapter_config(args.rank)),
                                base_id=BASE_ID)
            ad_s, ad_replica, version = push_seconds(sender, adapter, target, args.repeats, bucket, tags, version)
            row.update(full_first_s=round(full_s[0], 4), full_s=round(statistics.median(full_s[1:]), 4),
                       adapter_first_s=round(ad_s[0], 4), adapter_s=round(statistics.median(ad_s[1:]), 5),
                       full_replica_s=round(statistics.median(full_replica[1:]), 5),
                       adapter_replica_s=round(statistics.median(ad_replica[1:]), 5))
            row["speedup"] = round(row["full_s"] / row["adapter_s"], 1)
            print(json.dumps(row), flush=True)
            rows.append(row)
            sender.close()
            del full, adapter
    finally:
        parent.send("exit")
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    return {"size": args.size, "rank": args.rank, "targets": TARGETS, "transports": rows}


# --------------------------------------------------------------------------------------------------
# decode: 4 adapters in a batch vs 1 vs the base


def decode_tps(engine, prompts, adapters: list[str], new_tokens: int, repeats: int) -> float:
    """Generated tokens/s of one engine call holding every prompt, rows split evenly over `adapters`."""
    from services.rollout.engine_torch.engine import _Job
    from services.rollout.types import GenerateBatch, PromptInput, SamplingParams

    per = -(-len(prompts) // len(adapters))
    batches = [GenerateBatch([PromptInput(id=str(i), prompt_ids=p)
                              for i, p in enumerate(prompts[k * per:(k + 1) * per])],
                             SamplingParams(n=1, temperature=1.0, max_tokens=new_tokens, adapter=a))
               for k, a in enumerate(adapters)]
    times = []
    for _ in range(repeats + 1):                 # the first call captures this bucket's graph: left out
        if engine.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        results = engine._generate_jobs([_Job(b, engine.check_batch(b), None) for b in batches])
        if engine.device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        tokens = sum(len(s.response_ids) for job in results for r in job for s in r.samples)
    return tokens / statistics.median(times[1:])


@contextmanager
def kernel_off(off: bool):
    """Engines built inside apply adapters in their decode step with torch ops, not lora_expand's kernel."""
    from services.rollout.engine_torch import lora_expand

    available = lora_expand.available
    if off:
        lora_expand.available = lambda device, sizes: False
    try:
        yield
    finally:
        lora_expand.available = available


def run_decode(args) -> dict:
    from services.rollout.engine_torch.engine import TorchEngine

    cuda = args.device.startswith("cuda")
    dtype = "bfloat16" if cuda else "float32"
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(1, SHAPES[args.size]["vocab_size"], (args.batch, args.prompt_len), generator=g).tolist()
    out = {"size": args.size, "rank": args.rank, "batch": args.batch, "prompt_len": args.prompt_len,
           "new_tokens": args.new_tokens, "repeats": args.repeats}
    names = [f"a{i}" for i in range(4)]
    variants = (("none", False, ()), ("lora", True, (("base_tokens_per_s", [""]), ("one_adapter_tokens_per_s", names[:1]),
                                                    ("four_adapters_tokens_per_s", names))),
                ("torch_ops", True, (("torch_ops_base_tokens_per_s", [""]),
                                     ("torch_ops_four_adapters_tokens_per_s", names))))
    for variant, lora, runs in variants:
        model = build_model(args.size, args.device, getattr(torch, dtype))
        with kernel_off(variant == "torch_ops"):
            engine = TorchEngine(lora_settings(args.size, args.device, dtype, lora=lora, rank=args.rank,
                                               max_loras=4, kv_cache=args.kv_cache), model=model, tokenizer=None)
            engine.warm_up()
        out["cuda_graphs"] = bool(engine.resolved.value("rollout.cuda_graphs"))
        out["kv_cache"] = engine.resolved.value("rollout.kv_cache")
        if not lora:
            out["base_no_lora_engine_tokens_per_s"] = round(decode_tps(engine, prompts, [""], args.new_tokens,
                                                                       args.repeats), 1)
        for i, name in enumerate(names if lora else ()):
            engine.load_adapter(name, 1, adapter_config(args.rank),
                                adapter_tensors(model, args.rank, model.dtype, args.device, seed=10 + i))
        for key, adapters in runs:
            out[key] = round(decode_tps(engine, prompts, adapters, args.new_tokens, args.repeats), 1)
        print(json.dumps(out), flush=True)
        del engine, model
        if cuda:
            torch.cuda.empty_cache()
    return out


PARTS = {"sync": run_sync, "decode": run_decode}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="sync,decode")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--tiny", action="store_true", help="tiny shape (a CPU smoke test of the code paths)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--kv-cache", default="none", choices=["none", "paged", "auto"],
                        help="the decode part's rollout.kv_cache (none: the series' unpaged decoder)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "lora_gpu.json"))
    args = parser.parse_args(argv)
    args.size = "tiny" if args.tiny else "1.5b"
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise SystemExit(f"--parts: unknown {unknown} (known: {sorted(PARTS)})")
    out_path = Path(args.out)
    result = json.loads(out_path.read_text()) if out_path.exists() else {}
    for p in parts:
        result[p] = PARTS[p](args)
    result["machine"] = {"device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
                         "torch": torch.__version__}
    from provenance import stamp

    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(stamp("lora_gpu", result), indent=2) + "\n")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
