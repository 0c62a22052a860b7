"""Preference pairs for DPO on the arithmetic task: the correct answer over a typical wrong one.

The wrong answer is the one a model that forgets carries gives (each column mod 10) when the problem
has a carry, and an off-by-one last digit otherwise. `python -m examples.arith.preferences` writes
data/dpo_train.jsonl (from the train split) and data/dpo_heldout.jsonl (from the held-out split).
"""

from __future__ import annotations

import random
from pathlib import Path

from examples.arith.task import answer_of, has_carry, no_carry_answer, read_jsonl, write_jsonl

DATA = Path(__file__).resolve().parent / "data"


def wrong_answer(prompt: str, rng: random.Random) -> str:
    if has_carry(prompt):
        wrong = no_carry_answer(prompt)
        if wrong != answer_of(prompt):
            return wrong
    value = int(answer_of(prompt))
    return str(max(0, value + rng.choice([-1, 1])) if value > 0 else 1)


def make_pairs(rows: list[dict], *, seed: int) -> list[dict]:
    rng = random.Random(seed)
    pairs = []
    for row in rows:
        rejected = wrong_answer(row["prompt"], rng)
        if rejected == row["answer"]:
            continue
        pairs.append({"prompt": row["prompt"], "chosen": row["answer"], "rejected": rejected,
                      "answer": row["answer"], "data_source": "arith"})
    return pairs


def main() -> None:
    train = read_jsonl(DATA / "train.jsonl")[:3000]
    heldout = read_jsonl(DATA / "heldout.jsonl")
    write_jsonl(DATA / "dpo_train.jsonl", make_pairs(train, seed=0))
    write_jsonl(DATA / "dpo_heldout.jsonl", make_pairs(heldout, seed=1))


if __name__ == "__main__":
    main()
