"""Make the distillation teacher: the SFT model after a short seeded GRPO run on the arith task, saved to teacher/."""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file (python examples/arith/teacher.py): make `examples` importable
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from transformers import Qwen2ForCausalLM

from examples.arith.sft import MAX_NEW_TOKENS, MODEL_DIR, build_tokenizer, evaluate
from examples.arith.task import DEFAULT_DIR, read_jsonl, reward

TEACHER_DIR = Path(__file__).resolve().parent / "teacher"


def rollout(model, tokenizer, prompts: list[str], n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """n samples per prompt at temperature 1: (sequences [P*n, W], attention mask [P*n, W], prompt width).
    The mask covers the left-padded prompt and each response up to and including its eos."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        seqs = model.generate(**enc, max_new_tokens=MAX_NEW_TOKENS, num_return_sequences=n, do_sample=True,
                              temperature=1.0, top_k=0, top_p=1.0, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=tokenizer.eos_token_id)
    width = enc["input_ids"].shape[1]
    resp = seqs[:, width:]
    # A response's tokens: everything before its first eos, and that eos (what the sampler decided).
    ended = (resp == tokenizer.eos_token_id).long().cumsum(-1)
    resp_mask = ((ended - (resp == tokenizer.eos_token_id).long()) == 0).long()
    mask = torch.cat([enc["attention_mask"].repeat_interleave(n, 0), resp_mask], dim=1)
    return seqs, mask, width


def grpo_step(model, opt, tokenizer, rows: list[dict], n: int) -> float:
    """One on-policy GRPO step (group-normalised advantages, token-mean policy gradient); returns mean reward."""
    seqs, mask, width = rollout(model, tokenizer, [r["prompt"] for r in rows], n)
    texts = tokenizer.batch_decode(seqs[:, width:] * mask[:, width:], skip_special_tokens=True)
    rewards = torch.tensor([reward(t, rows[i // n]["answer"]) for i, t in enumerate(texts)]).view(-1, n)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).view(-1, 1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=seqs, attention_mask=mask, position_ids=positions).logits[:, width - 1:-1]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, seqs[:, width:].unsqueeze(-1)).squeeze(-1)
    tok = mask[:, width:].float()
    loss = -(adv * logp * tok).sum() / tok.sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(rewards.mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=str(MODEL_DIR), help="the SFT model it starts from")
    p.add_argument("--out", default=str(TEACHER_DIR))
    p.add_argument("--data", default=str(DEFAULT_DIR))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    data = Path(args.data)
    train_rows, heldout = read_jsonl(data / "train.jsonl"), read_jsonl(data / "heldout.jsonl")
    tok = build_tokenizer()
    model = Qwen2ForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    print(f"heldout_greedy_before {evaluate(model, tok, heldout):.3f}", flush=True)
    t0 = time.time()
    for step in range(1, args.steps + 1):
        r = grpo_step(model, opt, tok, rng.sample(train_rows, args.prompts), args.n)
        if step % 10 == 0:
            print(f"step {step:3d} reward {r:.3f}", flush=True)
    print(f"grpo_seconds {time.time() - t0:.1f}")
    model.save_pretrained(args.out)
    build_tokenizer().save_pretrained(args.out)
    print(f"heldout_greedy {evaluate(model, tok, heldout):.3f}")


if __name__ == "__main__":
    main()
