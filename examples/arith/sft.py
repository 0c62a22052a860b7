"""Build the char-level tokenizer and tiny Qwen2 model for the arith task, SFT it on CPU, and report held-out accuracy."""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, processors
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from examples.arith.task import DEFAULT_DIR, has_carry, no_carry_answer, read_jsonl, reward

MODEL_DIR = Path(__file__).resolve().parent / "model"
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]  # pad must be id 0 (spec); bos 1, eos 2
# Letters are not used by the task; they exist so ad-hoc strings in tests/demos
# tokenize to something other than <unk>.
CHARS = list("0123456789+-= ") + list("abcdefghijklmnopqrstuvwxyz")
MAX_LEN = 64
# Concatenate contents and nothing else, but start with bos so that
# apply_chat_template(tokenize=True) yields exactly tokenizer(prompt)["input_ids"]:
# a rollout service may use either path and must see identical ids.
CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"
# Longest answer is "198" (3 chars) + eos; a little slack lets RL see overlong junk.
MAX_NEW_TOKENS = 6


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level HF tokenizer: one token per character, bos prepended, lossless decode."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    # BPE with no merges == pure per-character split, and it keeps spaces as
    # ordinary tokens (no pre-tokenizer is needed that would drop them).
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tk.add_special_tokens(SPECIAL_TOKENS)
    # Without a decoder, tokenizers joins tokens with " "; Fuse concatenates them
    # so decode(encode(x)) == x.
    tk.decoder = decoders.Fuse()
    tk.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=MAX_LEN,
        chat_template=CHAT_TEMPLATE,
    )


def build_model(tokenizer, *, hidden: int = 128, layers: int = 4, seed: int = 0) -> Qwen2ForCausalLM:
    """A ~1M-parameter Qwen2 so the real HF code paths (GQA, RoPE, tied head) are exercised cheaply."""
    torch.manual_seed(seed)
    ids = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA, like real Qwen2 checkpoints
        max_position_embeddings=MAX_LEN,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        dtype="float32",
        **ids,
    )
    # sdpa works on CPU and is what the services will default to.
    config._attn_implementation = "sdpa"
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(**ids, max_new_tokens=MAX_NEW_TOKENS)
    return model


def sft_batch(tokenizer, rows: list[dict]) -> dict[str, torch.Tensor]:
    """Right-padded ``<s>prompt answer</s>`` with labels only on answer + eos.

    Masking the prompt keeps the model from spending capacity on predicting
    random operands, and matches what RL later optimises (the response only).
    """
    seqs, labels = [], []
    for r in rows:
        p = tokenizer(r["prompt"])["input_ids"]
        a = tokenizer(r.get("target", r["answer"]), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append(p + a)
        labels.append([-100] * len(p) + a)
    width = max(map(len, seqs))
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
    attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    lab = torch.tensor([l + [-100] * (width - len(l)) for l in labels])
    return {"input_ids": input_ids, "attention_mask": attn, "labels": lab}


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], *, greedy: bool = True, temperature: float = 1.0,
             num_samples: int = 1, max_new_tokens: int = MAX_NEW_TOKENS) -> list[list[str]]:
    """Responses (decoded up to eos, specials dropped) per prompt: ``out[i][j]`` is sample j of prompt i."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    kw = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    out = model.generate(**enc, max_new_tokens=max_new_tokens, num_return_sequences=num_samples,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **kw)
    gen = out[:, enc["input_ids"].shape[1]:].tolist()
    texts = []
    for ids in gen:
        if tokenizer.eos_token_id in ids:
            ids = ids[: ids.index(tokenizer.eos_token_id)]
        texts.append(tokenizer.decode(ids, skip_special_tokens=True))
    return [texts[i * num_samples:(i + 1) * num_samples] for i in range(len(prompts))]


def evaluate(model, tokenizer, rows: list[dict], *, greedy: bool = True, temperature: float = 1.0,
             num_samples: int = 1, batch_size: int = 256) -> float:
    """Fraction of rows where any of ``num_samples`` responses exactly matches the answer.

    ``greedy=True`` gives plain greedy accuracy; ``greedy=False, num_samples=8``
    gives pass@8, the quantity that says whether GRPO will see any reward.
    """
    was_training = model.training
    model.eval()
    hits = 0
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        outs = generate(model, tokenizer, [r["prompt"] for r in chunk], greedy=greedy,
                        temperature=temperature, num_samples=1 if greedy else num_samples)
        hits += sum(any(reward(o, r["answer"]) for o in samples) for samples, r in zip(outs, chunk))
    model.train(was_training)
    return hits / max(len(rows), 1)


def teacher_target(row: dict, rng: random.Random, carry_drop: float) -> str:
    """The SFT label: the true answer, except carry/borrow problems get the
    carry-ignoring answer with probability ``carry_drop``.

    Why a deliberately sloppy teacher: a cleanly trained model is either at ~100%
    or, if stopped early, in a fragile half-learned state where RL noise destroys
    it. Imitating a teacher that "forgets carries" 60% of the time gives a
    converged, stable policy whose greedy answer is wrong on every carry problem
    (~60% of problems) yet which samples the right answer ~40% of the time there:
    partial greedy accuracy, high pass@8, and a single behaviour for RL to fix.
    Re-drawn on every visit so the model learns the mixture, not per-row labels.
    """
    if carry_drop > 0 and has_carry(row["prompt"]) and rng.random() < carry_drop:
        return no_carry_answer(row["prompt"])
    return row["answer"]


def train(model, tokenizer, rows: list[dict], *, steps: int, seed: int, lr: float = 1e-3,
          batch_size: int = 64, warmup: int = 50, carry_drop: float = 0.0,
          eval_rows: list[dict] | None = None, eval_every: int = 0) -> None:
    """AdamW with linear warmup then cosine decay to 10% over ``steps``."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    )
    model.train()
    order: list[int] = []
    for step in range(1, steps + 1):
        if len(order) < batch_size:  # epoch boundary: reshuffle deterministically
            order += rng.sample(range(len(rows)), len(rows))
        picked = [rows[j] for j in order[:batch_size]]
        batch = sft_batch(tokenizer, [{**r, "target": teacher_target(r, rng, carry_drop)} for r in picked])
        del order[:batch_size]
        loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if eval_every and eval_rows and step % eval_every == 0:
            acc = evaluate(model, tokenizer, eval_rows)
            print(f"step {step:5d} loss {loss.item():.4f} heldout_greedy {acc:.3f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=str(MODEL_DIR))
    p.add_argument("--data", default=str(DEFAULT_DIR), help="dir with train.jsonl / heldout.jsonl")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--carry-drop", type=float, default=0.6,
                   help="probability the SFT teacher ignores carries on carry/borrow problems")
    p.add_argument("--eval-every", type=int, default=0)
    args = p.parse_args()

    torch.use_deterministic_algorithms(True)
    data = Path(args.data)
    train_rows, heldout = read_jsonl(data / "train.jsonl"), read_jsonl(data / "heldout.jsonl")
    tok = build_tokenizer()
    model = build_model(tok, hidden=args.hidden, layers=args.layers, seed=args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params}")

    t0 = time.time()
    train(model, tok, train_rows, steps=args.steps, seed=args.seed, lr=args.lr, batch_size=args.batch_size,
          carry_drop=args.carry_drop, eval_rows=heldout, eval_every=args.eval_every)
    print(f"sft_seconds {time.time() - t0:.1f}")

    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    torch.manual_seed(args.seed)  # sampling-based metrics are reproducible too
    print(f"heldout_greedy {evaluate(model, tok, heldout):.3f}")
    print(f"train_greedy {evaluate(model, tok, train_rows[:500]):.3f}")
    print(f"heldout_pass@8_t1 {evaluate(model, tok, heldout[:100], greedy=False, num_samples=8):.3f}")


if __name__ == "__main__":
    main()
