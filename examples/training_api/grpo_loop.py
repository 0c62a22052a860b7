"""GRPO on the arithmetic task, written as a user's own loop over the training API (docs/training_api.md): sample
groups from the current adapter, score them, turn group-normalised rewards into per-token advantages, one
forward_backward under the importance-sampling loss and one optim_step per batch. Held-out greedy accuracy before
and after.

    meshrl mesh examples/arith/grpo_lora.yaml --detach     # trainer (LoRA rank 8) + rollout replicas + this API
    python examples/training_api/grpo_loop.py              # finds the API in the mesh file; --address to name one
    meshrl mesh --stop
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

from examples.arith.task import read_jsonl, reward  # noqa: E402
from services.training_api.client import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "arith" / "data"


def accuracy(tc, tok, rows) -> float:
    """Greedy exact-match accuracy over `rows`."""
    prompts = [ModelInput.from_ints(p) for p in tok.encode_batch([r["prompt"] for r in rows])]
    results = tc.sample_batch(prompts, 1, SamplingParams(max_tokens=6, temperature=0.0)).result()
    texts = tok.decode_batch([r.sequences[0].tokens for r in results])
    return sum(reward(t, r["answer"]) for t, r in zip(texts, rows)) / len(rows)


def group_datums(prompt: list[int], sequences, rewards: list[float]) -> list[Datum]:
    """GRPO: each sample's advantage is its reward normalised within its group, on every token it sampled."""
    mean, std = statistics.mean(rewards), statistics.pstdev(rewards)
    if std == 0:
        return []                                   # every sample scored alike: no signal in this group
    data = []
    for seq, r in zip(sequences, rewards):
        tokens, skip = prompt + seq.tokens, len(prompt) - 1      # positions that predict prompt tokens carry no loss
        adv = (r - mean) / (std + 1e-6)
        data.append(Datum(model_input=ModelInput.from_ints(tokens[:-1]),
                          loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": [0.0] * skip + seq.logprobs,
                                          "advantages": [0.0] * skip + [adv] * len(seq.tokens)}))
    return data


def train(args) -> tuple[float, float]:
    service = ServiceClient(args.address)
    tc = service.create_lora_training_client(base_model=args.base_model, rank=args.rank)
    try:
        tok = tc.get_tokenizer()
        rows, heldout = read_jsonl(DATA / "train.jsonl"), read_jsonl(DATA / "heldout.jsonl")[:args.heldout]
        rng, before = random.Random(args.seed), accuracy(tc, tok, heldout)
        print(f"step 0: held-out accuracy {before:.3f}", flush=True)
        for step in range(1, args.steps + 1):
            batch = rng.sample(rows, args.batch)
            prompts = tok.encode_batch([r["prompt"] for r in batch])
            results = tc.sample_batch([ModelInput.from_ints(p) for p in prompts], args.group,
                                      SamplingParams(max_tokens=6, temperature=1.0, seed=args.seed + step)).result()
            data, rewards = [], []
            for row, prompt, res in zip(batch, prompts, results):
                scores = [reward(t, row["answer"]) for t in tok.decode_batch([s.tokens for s in res.sequences])]
                data += group_datums(prompt, res.sequences, scores)
                rewards += scores
            if data:
                tc.forward_backward(data, "importance_sampling")
                tc.optim_step(AdamParams(learning_rate=args.lr))
            line = f"step {step}: reward {statistics.mean(rewards):.3f}, {len(data)} sequences trained"
            if step % args.eval_every == 0 and step < args.steps:
                line += f", held-out accuracy {accuracy(tc, tok, heldout):.3f}"
            print(line, flush=True)
        after = accuracy(tc, tok, heldout)
        print(f"held-out accuracy {before:.3f} -> {after:.3f} ({100 * (after - before):+.1f} points) in "
              f"{args.steps} steps", flush=True)
        return before, after
    finally:
        tc.close()
        service.close()


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])   # the first paragraph, whole
    p.add_argument("--address", help="the training API (default: $MESHRL_TRAINING_API, else the mesh file)")
    p.add_argument("--base-model", default="examples/arith/model")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank: the trainer's actor.lora.rank")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=16, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--heldout", type=int, default=200, help="held-out rows evaluated")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


if __name__ == "__main__":
    train(parse())
