"""Two-operand arithmetic task (``"37+45="`` -> ``"82"``) with a disjoint, seeded train/held-out split."""

from __future__ import annotations

import functools
import hashlib
import json
import random
import re
from pathlib import Path
from typing import Iterable

DATA_SOURCE = "arith"
MAX_OPERAND = 99
# Problems whose (op, a, b) digest is 0 mod HELDOUT_MOD are held-out only. Using a
# content hash rather than sampling means the split is disjoint *by construction*:
# no seed, row count or op mix can ever leak a held-out problem into train.
HELDOUT_MOD = 10
# Addition only by default: ~70% of a+b problems need a carry, which is what the
# SFT teacher gets wrong (see sft.teacher_target), so this leaves RL ~70 points of
# headroom. Subtraction (a >= b, answer never negative) is supported but opt-in:
# only ~40% of it borrows, which would shrink that headroom.
OPS = ("+", "-")
DEFAULT_OPS = ("+",)
DEFAULT_DIR = Path(__file__).resolve().parent / "data"

_PROMPT_RE = re.compile(r"^\s*(\d+)\s*([+-])\s*(\d+)\s*=\s*$")


def _is_heldout(op: str, a: int, b: int) -> bool:
    # md5 rather than hash(): Python's str hash is salted per process, which would
    # make the split differ between runs.
    digest = hashlib.md5(f"{a}{op}{b}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % HELDOUT_MOD == 0


@functools.lru_cache(maxsize=None)  # 20k md5s per call; tests and evals call this a lot
def _universe(split: str, ops: tuple[str, ...] = DEFAULT_OPS) -> tuple[tuple[str, int, int], ...]:
    """All problems belonging to ``split``, in a fixed canonical order."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    want_heldout = split == "heldout"
    out = []
    for op in ops:
        if op not in OPS:
            raise ValueError(f"unsupported op {op!r}")
        for a in range(MAX_OPERAND + 1):
            for b in range(MAX_OPERAND + 1):
                # Subtraction only with non-negative results keeps the answer
                # format digits-only (no leading '-' to learn).
                if op == "-" and b > a:
                    continue
                if _is_heldout(op, a, b) == want_heldout:
                    out.append((op, a, b))
    return tuple(out)


def answer_of(prompt: str) -> str:
    """The exact expected answer string for a prompt such as ``"37+45="``."""
    a, op, b = _parse(prompt)
    return str(a + b if op == "+" else a - b)


def _parse(prompt: str) -> tuple[int, str, int]:
    m = _PROMPT_RE.match(prompt)
    if m is None:
        raise ValueError(f"not an arithmetic prompt: {prompt!r}")
    return int(m.group(1)), m.group(2), int(m.group(3))


def has_carry(prompt: str) -> bool:
    """True iff computing the answer column-by-column needs a carry (``+``) or borrow (``-``)."""
    a, op, b = _parse(prompt)
    if op == "+":
        return a % 10 + b % 10 >= 10 or a + b >= 100
    return a % 10 < b % 10  # a >= b, so only the ones column can borrow


def no_carry_answer(prompt: str) -> str:
    """The classic wrong answer that ignores carries/borrows: each column mod 10.

    ``37+45=`` -> ``"72"`` (true 82), ``85+37=`` -> ``"12"`` (true 122),
    ``52-17=`` -> ``"45"`` (true 35). Equals :func:`answer_of` when there is no carry.
    """
    a, op, b = _parse(prompt)
    sign = 1 if op == "+" else -1
    ones = (a % 10 + sign * (b % 10)) % 10
    tens = (a // 10 + sign * (b // 10)) % 10
    return str(tens * 10 + ones)


def make_problems(n: int, *, seed: int, split: str, ops: tuple[str, ...] = DEFAULT_OPS) -> list[dict]:
    """``n`` distinct problems from ``split``, deterministic in ``seed``.

    Sampling is without replacement so small held-out sets have no duplicates
    (which would silently over-weight some problems in accuracy numbers). If ``n``
    exceeds the split size the whole split is returned, shuffled.
    """
    universe = _universe(split, tuple(ops))
    rng = random.Random(f"{seed}:{split}")
    picked = rng.sample(universe, min(n, len(universe)))
    rows = []
    for op, a, b in picked:
        prompt = f"{a}{op}{b}="
        rows.append({"prompt": prompt, "answer": answer_of(prompt), "data_source": DATA_SOURCE})
    return rows


def reward(response: str, answer: str) -> float:
    """Exact-match reward: 1.0 iff the stripped response equals the answer."""
    return 1.0 if response.strip() == answer else 0.0


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def read_jsonl(path: str | Path) -> list[dict]:
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def build_datasets(
    out_dir: str | Path = DEFAULT_DIR, *, n_train: int = 5000, n_heldout: int = 200, seed: int = 0
) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``heldout.jsonl`` under ``out_dir``; returns both paths."""
    out_dir = Path(out_dir)
    train_path, heldout_path = out_dir / "train.jsonl", out_dir / "heldout.jsonl"
    write_jsonl(train_path, make_problems(n_train, seed=seed, split="train"))
    write_jsonl(heldout_path, make_problems(n_heldout, seed=seed, split="heldout"))
    return train_path, heldout_path


def main() -> None:
    from examples.common import dataset_main  # here, not at the top: importing the task stays torch-free

    dataset_main(__doc__, build_datasets, DEFAULT_DIR)


if __name__ == "__main__":
    main()
