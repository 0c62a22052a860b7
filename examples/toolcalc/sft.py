"""SFT the tiny toolcalc model on the sloppy teacher's episodes (rendered token for token as the episode loop renders
them), then measure it by running real episodes: the model, the chat template's observation deltas and the real
`calculator` tool code."""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: make `examples` importable
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from transformers import Qwen2ForCausalLM

from examples.common import sft_steps, tiny_qwen2
from examples.toolcalc.chat import MAX_LEN, build_tokenizer, encode, prompt_ids
from examples.toolcalc.episodes import TOOLS, evaluate
from examples.toolcalc.task import DEFAULT_DIR, TEACHER_MIX, TeacherEpisode, operands, teacher_episode
from examples.wordproblems.task import read_parquet
from services.common.chat_delta import observation_ids

MODEL_DIR = Path(__file__).resolve().parent / "model"
# A call turn is 66 tokens (`<tool_call>\n{"name": "calculator", ...}\n</tool_call>` and the end-of-turn token).
MAX_NEW_TOKENS = 80


def build_model(tokenizer, *, hidden: int = 128, layers: int = 4, seed: int = 0) -> Qwen2ForCausalLM:
    """A ~0.8M-parameter Qwen2 (GQA, RoPE, tied embeddings): the real HF code paths, cheap on a CPU."""
    return tiny_qwen2(tokenizer, hidden=hidden, layers=layers, seed=seed, max_len=MAX_LEN,
                      max_new_tokens=MAX_NEW_TOKENS)


def episode_ids(tokenizer, row: dict, episode: TeacherEpisode, *, tools=TOOLS) -> tuple[list[int], list[int]]:
    """(ids, labels) of a teacher episode exactly as the episode loop assembles one: the prompt through the template,
    each assistant turn's ids then the end-of-turn token (the eos the model samples), and after each turn but the
    last the template's delta for the tool message (observation_ids, end-of-turn already sampled). Labels are the
    ids on assistant tokens, -100 on the prompt and observations."""
    ids = prompt_ids(tokenizer, row["prompt"], tools)
    labels = [-100] * len(ids)
    eos, eos_text = tokenizer.eos_token_id, tokenizer.eos_token
    for i, turn in enumerate(episode.turns):
        sampled = encode(tokenizer, turn) + [eos]
        ids += sampled
        labels += sampled
        if i < len(episode.observations):
            obs = observation_ids(tokenizer, [{"role": "tool", "content": episode.observations[i]}], end_text=eos_text)
            ids += obs
            labels += [-100] * len(obs)
    return ids, labels


def sft_batch(tokenizer, rows: list[dict], rng: random.Random, mix: dict[str, float],
              tools_share: float = 1.0) -> dict[str, torch.Tensor]:
    """Right-padded teacher episodes, labels on the assistant tokens only; `tools_share` of the prompts are rendered
    with the tools (the system turn naming them), the rest without."""
    pairs = [episode_ids(tokenizer, r, teacher_episode(*operands(r), rng, mix),
                         tools=TOOLS if rng.random() < tools_share else None) for r in rows]
    width, pad = max(len(i) for i, _ in pairs), tokenizer.pad_token_id
    return {"input_ids": torch.tensor([i + [pad] * (width - len(i)) for i, _ in pairs]),
            "attention_mask": torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in pairs]),
            "labels": torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in pairs])}


def train(model, tokenizer, rows: list[dict], *, steps: int, seed: int, lr: float, batch_size: int,
          mix: dict[str, float], tools_share: float = 1.0, warmup: int = 50, eval_rows: list[dict] | None = None, eval_every: int = 0) -> None:
    """AdamW with linear warm-up then cosine decay to 10% over `steps`; a fresh teacher episode per row each time."""
    def batch(picked, rng):
        return sft_batch(tokenizer, picked, rng, mix, tools_share)

    for step, loss in sft_steps(model, rows, batch, steps=steps, seed=seed, lr=lr, batch_size=batch_size,
                                warmup=warmup):
        if step % 50 == 0:
            print(f"step {step:5d} loss {loss.item():.4f}", flush=True)
        if eval_every and eval_rows and step % eval_every == 0:
            print(f"step {step:5d} heldout {json.dumps(evaluate(model, tokenizer, eval_rows))}", flush=True)
            model.train()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=str(MODEL_DIR))
    p.add_argument("--data", default=str(DEFAULT_DIR), help="dir with train.parquet / heldout.parquet")
    p.add_argument("--init", default="", help="model folder to continue from ('' = random weights)")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--mix", default=json.dumps(TEACHER_MIX), help="the teacher's modes and their weights (JSON)")
    p.add_argument("--tools-share", type=float, default=1.0,
                   help="share of SFT prompts rendered with the tools' system turn (the rest without)")
    p.add_argument("--eval-every", type=int, default=0)
    args = p.parse_args()

    torch.use_deterministic_algorithms(True)
    train_rows = read_parquet(Path(args.data) / "train.parquet")
    heldout = read_parquet(Path(args.data) / "heldout.parquet")
    tok = build_tokenizer()
    model = (Qwen2ForCausalLM.from_pretrained(args.init, dtype=torch.float32) if args.init
             else build_model(tok, seed=args.seed))
    print(f"params {sum(p.numel() for p in model.parameters())}")
    t0 = time.time()
    train(model, tok, train_rows, steps=args.steps, seed=args.seed, lr=args.lr, batch_size=args.batch_size,
          mix=json.loads(args.mix), tools_share=args.tools_share, eval_rows=heldout[:50], eval_every=args.eval_every)
    print(f"sft_seconds {time.time() - t0:.1f}")
    model.save_pretrained(args.out)
    build_tokenizer().save_pretrained(args.out)  # a fresh instance: padding calls mutate the backend's state
    torch.manual_seed(args.seed)
    print(f"heldout_greedy {json.dumps(evaluate(model, tok, heldout))}")
    print(f"heldout_sampled_t1 {json.dumps(evaluate(model, tok, heldout[:100], greedy=False))}")


if __name__ == "__main__":
    main()
