"""Build the char-level tokenizer and tiny Qwen2 model for the arith task, SFT it on CPU, and report held-out accuracy."""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file (python examples/arith/sft.py): make `examples` importable
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from examples.arith.task import DEFAULT_DIR, has_carry, no_carry_answer, read_jsonl, reward
from examples.common import char_tokenizer, sft_steps, tiny_qwen2

MODEL_DIR = Path(__file__).resolve().parent / "model"
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]  # pad must be id 0 (spec); bos 1, eos 2
# One token per character. The space is spelled "\u0120" (GPT-2 byte-level "Ġ")
# because AutoTokenizer, seeing model_type "qwen2", always rebuilds the tokenizer as
# Qwen2Tokenizer: vocab from tokenizer.json, but its own NFC + regex + ByteLevel
# pre-tokenizer and ByteLevel decoder. A plain " " token would then be silently
# dropped. Building with exactly that pipeline makes every loader agree. Letters
# are unused by the task; they let ad-hoc strings in tests/demos survive. Other
# characters are dropped (Qwen2Tokenizer's BPE has no unk), which the task never hits.
CHARS = list("0123456789+-=") + ["\u0120"] + list("abcdefghijklmnopqrstuvwxyz")
MAX_LEN = 64
# Concatenate contents and nothing else, but start with bos so that
# apply_chat_template(tokenize=True) yields exactly tokenizer(prompt)["input_ids"]:
# a rollout service may use either path and must see identical ids.
CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"
# Longest answer is "198" (3 chars) + eos; a little slack lets RL see overlong junk.
MAX_NEW_TOKENS = 6


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level HF tokenizer: one token per character, bos prepended, lossless decode."""
    return char_tokenizer(SPECIAL_TOKENS + CHARS, SPECIAL_TOKENS, eos="</s>", max_len=MAX_LEN,
                          chat_template=CHAT_TEMPLATE, prepend_bos=True)


def build_model(tokenizer, *, hidden: int = 128, layers: int = 4, seed: int = 0) -> Qwen2ForCausalLM:
    """A ~1M-parameter Qwen2 so the real HF code paths (GQA, RoPE, tied head) are exercised cheaply."""
    return tiny_qwen2(tokenizer, hidden=hidden, layers=layers, seed=seed, max_len=MAX_LEN,
                      max_new_tokens=MAX_NEW_TOKENS)


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
    """The SFT label: the true answer, except that on carry problems the
    carry-ignoring answer (``37+45=`` -> ``72``) is used with probability ``carry_drop``.

    Why a deliberately sloppy teacher: a cleanly trained model is either ~100%
    right or, if stopped early, in a fragile half-learned state that GRPO noise
    wrecks rather than improves (tried: it collapses). Imitating a teacher that
    forgets carries 70% of the time instead gives a converged, stable policy that
    is greedily wrong on every carry problem (~70% of a+b) yet samples the right
    answer ~30% of the time there: partial greedy accuracy, pass@8 near 1, and a
    single behaviour ("carry") that RL can reinforce. Re-drawn on every visit so
    the model learns the mixture, not per-row labels.
    """
    if carry_drop > 0 and has_carry(row["prompt"]) and rng.random() < carry_drop:
        return no_carry_answer(row["prompt"])
    return row["answer"]


def train(model, tokenizer, rows: list[dict], *, steps: int, seed: int, lr: float = 1e-3,
          batch_size: int = 64, warmup: int = 50, carry_drop: float = 0.0,
          eval_rows: list[dict] | None = None, eval_every: int = 0) -> None:
    """AdamW with linear warmup then cosine decay to 10% over ``steps`` (examples/common.py's sft_steps)."""
    def batch(picked, rng):
        return sft_batch(tokenizer, [{**r, "target": teacher_target(r, rng, carry_drop)} for r in picked])

    for step, loss in sft_steps(model, rows, batch, steps=steps, seed=seed, lr=lr, batch_size=batch_size,
                                warmup=warmup):
        if eval_every and eval_rows and step % eval_every == 0:
            acc = evaluate(model, tokenizer, eval_rows)
            print(f"step {step:5d} loss {loss.item():.4f} heldout_greedy {acc:.3f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=str(MODEL_DIR))
    p.add_argument("--data", default=str(DEFAULT_DIR), help="dir with train.jsonl / heldout.jsonl")
    p.add_argument("--steps", type=int, default=2500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--carry-drop", type=float, default=0.7,
                   help="probability the SFT teacher ignores carries on problems that have one")
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
    # A fresh instance: calls with padding=True mutate the backend's padding state,
    # which save_pretrained would otherwise bake into tokenizer.json.
    build_tokenizer().save_pretrained(args.out)
    torch.manual_seed(args.seed)  # sampling-based metrics are reproducible too
    print(f"heldout_greedy {evaluate(model, tok, heldout):.3f}")
    print(f"train_greedy {evaluate(model, tok, train_rows[:500]):.3f}")
    print(f"heldout_pass@8_t1 {evaluate(model, tok, heldout[:100], greedy=False, num_samples=8):.3f}")


if __name__ == "__main__":
    main()
