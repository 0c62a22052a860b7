"""Build the chat tokenizer and tiny Qwen2 model of the word problems, SFT it on CPU, report held-out accuracy."""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make `examples` importable
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2ForCausalLM

from examples.arith.sft import CHARS as ARITH_CHARS
from examples.arith.sft import MODEL_DIR as ARITH_MODEL
from examples.arith.sft import SPECIAL_TOKENS as ARITH_SPECIALS
from examples.common import char_tokenizer, sft_steps, tiny_qwen2
from examples.wordproblems.reward import compute_score
from examples.wordproblems.task import DEFAULT_DIR, has_carry, no_carry_result, parse_question, read_parquet, solution

MODEL_DIR = Path(__file__).resolve().parent / "model"
# The arith tokenizer's ids first (pad 0, bos 1, eos 2, unk 3, digits, `+-=`, space, a-z), so the arith model's
# embeddings carry over (`--init`); then the three roles, the end-of-turn token and the characters it lacks.
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
SPECIAL_TOKENS = ARITH_SPECIALS + ROLE_TOKENS
# One token per character; space and newline in GPT-2 byte-level spelling ("Ġ", "Ċ"), which the Qwen2 pipeline
# that AutoTokenizer forces on a qwen2 folder expects (examples/arith/sft.py says why).
CHARS = list("*/#.,?!:'") + ["\u010a"] + list("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
# A role marker, the message, the end-of-turn token; the generation prompt opens the assistant's turn, whose
# end-of-turn token is the model's eos (generation stops there).
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
                 "<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
MAX_LEN = 128
# `99+99=198\n#### 198` is 18 tokens, then <|end|>; a little slack lets RL see overlong junk.
MAX_NEW_TOKENS = 24


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer with a chat template; no special tokens added by encoding (the template has bos)."""
    return char_tokenizer(ARITH_SPECIALS + ARITH_CHARS + ROLE_TOKENS + CHARS, SPECIAL_TOKENS, eos="<|end|>",
                          max_len=MAX_LEN, chat_template=CHAT_TEMPLATE)


def build_model(tokenizer, *, hidden: int = 128, layers: int = 4, seed: int = 0, init: str = "") -> Qwen2ForCausalLM:
    """A ~1M-parameter Qwen2; `init`: start from that model folder (the arith model already adds, carelessly),
    its embeddings grown to this vocabulary and its positions to MAX_LEN (RoPE: nothing learned per position)."""
    torch.manual_seed(seed)
    ids = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id)
    if init:
        model = Qwen2ForCausalLM.from_pretrained(init, dtype=torch.float32)
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        for key, value in dict(ids, max_position_embeddings=MAX_LEN).items():
            setattr(model.config, key, value)
        model.generation_config = GenerationConfig(**ids, max_new_tokens=MAX_NEW_TOKENS)
        return model
    return tiny_qwen2(tokenizer, hidden=hidden, layers=layers, seed=seed, max_len=MAX_LEN,
                      max_new_tokens=MAX_NEW_TOKENS)


def prompt_ids(tokenizer, row: dict) -> list[int]:
    """The row's chat messages through the template once, with the generation prompt: exactly one bos."""
    out = tokenizer.apply_chat_template(list(row["prompt"]), add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def teacher_target(row: dict, rng: random.Random, carry_drop: float) -> str:
    """The SFT label: the worked solution, except that on carry/borrow problems the teacher forgets the carry
    with probability `carry_drop` (`37+45=72\\n#### 72`): a converged model that is greedily wrong there yet
    samples the right answer often, so GRPO has a dense signal (examples/arith/sft.py says why)."""
    op, a, b = parse_question(row["prompt"][-1]["content"])
    if carry_drop > 0 and has_carry(op, a, b) and rng.random() < carry_drop:
        return solution(op, a, b, no_carry_result(op, a, b))
    return solution(op, a, b)


def sft_batch(tokenizer, rows: list[dict], targets: list[str]) -> dict[str, torch.Tensor]:
    """Right-padded prompt + target + end-of-turn, labels on the target and end-of-turn only."""
    seqs, labels = [], []
    for r, t in zip(rows, targets):
        p = prompt_ids(tokenizer, r)
        a = tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append(p + a)
        labels.append([-100] * len(p) + a)
    width, pad = max(map(len, seqs)), tokenizer.pad_token_id
    return {"input_ids": torch.tensor([s + [pad] * (width - len(s)) for s in seqs]),
            "attention_mask": torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs]),
            "labels": torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])}


@torch.no_grad()
def generate(model, tokenizer, rows: list[dict], *, greedy: bool = True, num_samples: int = 1) -> list[list[str]]:
    """Responses per row (decoded up to end-of-turn, special tokens skipped): `out[i][j]` is sample j of row i."""
    prompts = [prompt_ids(tokenizer, r) for r in rows]
    width, pad = max(map(len, prompts)), tokenizer.pad_token_id
    enc = {"input_ids": torch.tensor([[pad] * (width - len(p)) + p for p in prompts]),
           "attention_mask": torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])}
    kw = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    out = model.generate(**enc, max_new_tokens=MAX_NEW_TOKENS, num_return_sequences=num_samples,
                         pad_token_id=pad, eos_token_id=tokenizer.eos_token_id, **kw)
    texts = []
    for ids in out[:, width:].tolist():
        ids = ids[: ids.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in ids else ids
        texts.append(tokenizer.decode(ids, skip_special_tokens=True))
    return [texts[i * num_samples:(i + 1) * num_samples] for i in range(len(rows))]


def evaluate(model, tokenizer, rows: list[dict], *, greedy: bool = True, num_samples: int = 1,
             batch_size: int = 200) -> float:
    """Share of rows where any of `num_samples` responses scores 1 with reward.compute_score (greedy: accuracy)."""
    was_training = model.training
    model.eval()
    hits = 0
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        outs = generate(model, tokenizer, chunk, greedy=greedy, num_samples=1 if greedy else num_samples)
        hits += sum(any(compute_score(r["data_source"], o, r["reward_model"]["ground_truth"])["score"] for o in s)
                    for s, r in zip(outs, chunk))
    model.train(was_training)
    return hits / max(len(rows), 1)


def train(model, tokenizer, rows: list[dict], *, steps: int, seed: int, lr: float = 1e-3, batch_size: int = 64,
          warmup: int = 50, carry_drop: float = 0.0, eval_rows: list[dict] | None = None,
          eval_every: int = 0, save_every_eval: str = "", stop_after: int = 0) -> None:
    """AdamW with linear warm-up then cosine decay to 10% over `steps`; `stop_after`: stop after that many steps of
    the schedule (the model of step N of a longer run, which a later `--init` run continues)."""
    def batch(picked, rng):
        return sft_batch(tokenizer, picked, [teacher_target(r, rng, carry_drop) for r in picked])

    for step, loss in sft_steps(model, rows, batch, steps=steps, seed=seed, lr=lr, batch_size=batch_size,
                                warmup=warmup, stop_after=stop_after):
        if eval_every and eval_rows and step % eval_every == 0:
            print(f"step {step:5d} loss {loss.item():.4f} heldout_greedy {evaluate(model, tokenizer, eval_rows):.3f}",
                  flush=True)
            if save_every_eval:  # pick the SFT length by its held-out accuracy
                model.save_pretrained(f"{save_every_eval}/step_{step}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=str(MODEL_DIR))
    p.add_argument("--data", default=str(DEFAULT_DIR), help="dir with train.parquet / heldout.parquet")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--init", default=str(ARITH_MODEL), help="model folder to start from ('' = random weights)")
    p.add_argument("--carry-drop", type=float, default=0.7,
                   help="probability the SFT teacher forgets the carry on problems that have one")
    p.add_argument("--stop-after", type=int, default=0,
                   help="stop after N steps of the --steps schedule (a stage of README's Regenerate chain)")
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--save-dir", default="", help="with --eval-every: save the model at each evaluation here")
    args = p.parse_args()

    torch.use_deterministic_algorithms(True)
    train_rows = read_parquet(Path(args.data) / "train.parquet")
    heldout = read_parquet(Path(args.data) / "heldout.parquet")
    tok = build_tokenizer()
    model = build_model(tok, hidden=args.hidden, layers=args.layers, seed=args.seed, init=args.init)
    print(f"params {sum(p.numel() for p in model.parameters())}")
    t0 = time.time()
    train(model, tok, train_rows, steps=args.steps, seed=args.seed, lr=args.lr, batch_size=args.batch_size,
          carry_drop=args.carry_drop, eval_rows=heldout[:100], eval_every=args.eval_every,
          save_every_eval=args.save_dir, stop_after=args.stop_after)
    print(f"sft_seconds {time.time() - t0:.1f}")
    model.save_pretrained(args.out)
    build_tokenizer().save_pretrained(args.out)  # a fresh instance: padding calls mutate the backend's state
    torch.manual_seed(args.seed)
    print(f"heldout_greedy {evaluate(model, tok, heldout):.3f}")
    print(f"heldout_pass@8_t1 {evaluate(model, tok, heldout[:100], greedy=False, num_samples=8):.3f}")


if __name__ == "__main__":
    main()
