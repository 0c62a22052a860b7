"""GSM8K-shaped word problems over small numbers (`Ann has 37 pens. She buys 45. How many now?` -> `37+45=82\n#### 82`),
written in verl's Parquet schema with a disjoint, seeded train/held-out split."""

from __future__ import annotations

import hashlib
import random
import re
from pathlib import Path

DATA_SOURCE = "wordproblems"
ABILITY = "math"
MAX_OPERAND = 99
# Problems whose (op, a, b) digest is 0 mod HELDOUT_MOD are held-out only: the split is disjoint by construction,
# whatever the seed, the row count or the phrasing (the same numbers never appear on both sides).
HELDOUT_MOD = 10
# Share of subtraction problems; the rest add. About 70% of the additions carry and about 45% of the subtractions
# borrow, which is what the SFT teacher gets wrong (sft.teacher_target).
SUB_SHARE = 0.25
DEFAULT_DIR = Path(__file__).resolve().parent / "data"

NAMES = [("Ann", "she"), ("Bob", "he"), ("Sue", "she"), ("Tom", "he"), ("Eva", "she"), ("Max", "he")]
ITEMS = ["pens", "cards", "eggs", "coins", "books", "cups"]
ADD_VERBS = ["gets", "buys", "finds"]
SUB_VERBS = ["loses", "sells", "uses"]
_WORKED_RE = re.compile(r"(\d+)\s*([+-])\s*(\d+)\s*=\s*(\d+)")


def _is_heldout(op: str, a: int, b: int) -> bool:
    digest = hashlib.md5(f"{a}{op}{b}".encode()).digest()  # md5, not hash(): the same split in every process
    return int.from_bytes(digest[:8], "big") % HELDOUT_MOD == 0


def solve(op: str, a: int, b: int) -> int:
    return a + b if op == "+" else a - b


def has_carry(op: str, a: int, b: int) -> bool:
    """True iff the column-by-column sum needs a carry (`+`) or the difference a borrow (`-`)."""
    if op == "+":
        return a % 10 + b % 10 >= 10 or a + b >= 100
    return a % 10 < b % 10


def no_carry_result(op: str, a: int, b: int) -> int:
    """The classic wrong result that ignores carries and borrows (each column mod 10): 37+45 -> 72, 52-17 -> 45."""
    sign = 1 if op == "+" else -1
    return (a // 10 + sign * (b // 10)) % 10 * 10 + (a % 10 + sign * (b % 10)) % 10


def question(op: str, a: int, b: int, rng: random.Random) -> str:
    name, pronoun = rng.choice(NAMES)
    item = rng.choice(ITEMS)
    verb = rng.choice(ADD_VERBS if op == "+" else SUB_VERBS)
    return f"{name} has {a} {item}. {pronoun.capitalize()} {verb} {b}. How many now?"


def solution(op: str, a: int, b: int, result: int | None = None) -> str:
    """The worked line and the final answer, GSM8K's way: `37+45=82\\n#### 82` (`result` defaults to the truth)."""
    result = solve(op, a, b) if result is None else result
    return f"{a}{op}{b}={result}\n#### {result}"


def _problems(split: str, n: int, seed: int) -> list[tuple[str, int, int]]:
    """`n` distinct (op, a, b) of `split`, SUB_SHARE of them subtractions, deterministic in `seed`."""
    rng = random.Random(f"{seed}:{split}")
    pools = {op: [(op, a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)
                  if (op == "+" or b <= a) and _is_heldout(op, a, b) == (split == "heldout")] for op in "+-"}
    num_sub = min(round(n * SUB_SHARE), len(pools["-"]))
    picked = rng.sample(pools["+"], min(n - num_sub, len(pools["+"]))) + rng.sample(pools["-"], num_sub)
    rng.shuffle(picked)
    return picked


def make_rows(n: int, *, seed: int, split: str) -> list[dict]:
    """verl's Parquet rows: data_source, prompt (chat messages), ability, reward_model, extra_info."""
    rng = random.Random(f"{seed}:{split}:text")
    rows = []
    for index, (op, a, b) in enumerate(_problems(split, n, seed)):
        q = question(op, a, b, rng)
        answer = str(solve(op, a, b))
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": q}],
            "ability": ABILITY,
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": index, "question": q, "answer": solution(op, a, b),
                           "op": op, "carry": has_carry(op, a, b)},
        })
    return rows


def parse_question(text: str) -> tuple[str, int, int]:
    """(op, a, b) of a question this task wrote."""
    numbers = [int(x) for x in re.findall(r"\d+", text)]
    if len(numbers) != 2:
        raise ValueError(f"not a word problem of this task: {text!r}")
    return ("-" if any(v in text for v in SUB_VERBS) else "+"), numbers[0], numbers[1]


def write_parquet(path: str | Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def read_parquet(path: str | Path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def build_datasets(out_dir: str | Path = DEFAULT_DIR, *, n_train: int = 5000, n_heldout: int = 200,
                   seed: int = 0) -> tuple[Path, Path]:
    """train.parquet and heldout.parquet under `out_dir`."""
    out_dir = Path(out_dir)
    return (write_parquet(out_dir / "train.parquet", make_rows(n_train, seed=seed, split="train")),
            write_parquet(out_dir / "heldout.parquet", make_rows(n_heldout, seed=seed, split="heldout")))


def main() -> None:
    from examples.common import dataset_main  # here, not at the top: importing the task stays torch-free

    dataset_main(__doc__, build_datasets, DEFAULT_DIR)


if __name__ == "__main__":
    main()
