"""Three-digit multiplication with a `calculator` tool (`What is 123*456?` -> a calculator call, its result, then
`#### 56088`), written in verl's Parquet schema (agent field `agent_name: tool_agent`) with a disjoint, seeded
train/held-out split; and the sloppy teacher's episodes the SFT imitates."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path

from examples.wordproblems.task import write_parquet
from services.common.tool_calls import ToolCall, format_hermes
from services.env.calculator import evaluate, format_number
from services.env.types import ToolError

DATA_SOURCE = "toolcalc"
ABILITY = "math"
AGENT_NAME = "tool_agent"
TOOL = "calculator"
LOW, HIGH = 101, 999
# Problems whose "{a}*{b}" digest is 0 mod HELDOUT_MOD are held-out only: disjoint whatever the seed or row count.
HELDOUT_MOD = 10
DEFAULT_DIR = Path(__file__).resolve().parent / "data"
# The teacher's mix (sft.py imitates it): most of the time it estimates the product in its head (always wrong),
# otherwise it calls the calculator, with the right expression most of those times. A converged model of it
# guesses greedily (held-out greedy accuracy near 0) yet samples a right call about a third of the time: GRPO
# only has to make the call its first choice.
TEACHER_MIX = {"guess": 0.60, "call": 0.28, "wrong_call": 0.06, "bad_call": 0.06}


def _is_heldout(a: int, b: int) -> bool:
    digest = hashlib.md5(f"{a}*{b}".encode()).digest()  # md5, not hash(): the same split in every process
    return int.from_bytes(digest[:8], "big") % HELDOUT_MOD == 0


def _operand(rng: random.Random) -> int:
    """101..999, never a multiple of 100 (the teacher's estimate would then be exact)."""
    while (x := rng.randint(LOW, HIGH)) % 100 == 0:
        pass
    return x


def question(a: int, b: int) -> str:
    return f"What is {a}*{b}?"


def make_rows(n: int, *, seed: int, split: str) -> list[dict]:
    """verl's Parquet rows: data_source, prompt (chat messages), ability, reward_model, extra_info, agent_name."""
    rng = random.Random(f"{seed}:{split}")
    seen: set[tuple[int, int]] = set()
    rows = []
    while len(rows) < n:
        a, b = _operand(rng), _operand(rng)
        if (a, b) in seen or _is_heldout(a, b) != (split == "heldout"):
            continue
        seen.add((a, b))
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": question(a, b)}],
            "ability": ABILITY,
            "reward_model": {"style": "rule", "ground_truth": str(a * b)},
            "agent_name": AGENT_NAME,
            "extra_info": {"split": split, "index": len(rows), "a": a, "b": b},
        })
    return rows


def operands(row: dict) -> tuple[int, int]:
    return int(row["extra_info"]["a"]), int(row["extra_info"]["b"])


# ---- the teacher's episodes


@dataclass
class TeacherEpisode:
    """An episode as the loop records it: the assistant turns (text without the end-of-turn token) and, between
    them, the tool observations (what the env answers: the result, or `Error: <why>`)."""

    mode: str
    turns: list[str]
    observations: list[str]


def estimate(a: int, b: int) -> int:
    """The teacher's mental estimate: both operands rounded to hundreds (never exact, operands are not multiples
    of 100)."""
    return (a + 50) // 100 * 100 * ((b + 50) // 100 * 100)


def call_text(expression: str) -> str:
    return format_hermes(ToolCall(name=TOOL, arguments={"expression": expression}))


def calculator_observation(expression: str) -> str:
    """What the env's `calculator` answers (services/env/engine.py writes an error as `Error: <why>`)."""
    try:
        return format_number(evaluate(expression))
    except ToolError as e:
        return f"Error: {e}"


def wrong_expression(a: int, b: int, rng: random.Random) -> str:
    """A call that computes the wrong thing: the sum, or b with its last two digits swapped (a typo)."""
    if rng.random() < 0.5:
        return f"{a}+{b}"
    s = str(b)
    typo = s[0] + s[2] + s[1] if s[1] != s[2] else s[:2] + str((int(s[2]) + 1) % 10)
    return f"{a}*{typo}"


def teacher_episode(a: int, b: int, rng: random.Random, mix: dict[str, float] = TEACHER_MIX) -> TeacherEpisode:
    """One episode of the sloppy teacher for `a*b`, its mode drawn from `mix`."""
    mode = rng.choices(list(mix), weights=list(mix.values()))[0]
    if mode == "guess":
        return TeacherEpisode(mode, [f"#### {estimate(a, b)}"], [])
    expression = {"call": f"{a}*{b}", "wrong_call": wrong_expression(a, b, rng), "bad_call": f"{a} x {b}"}[mode]
    observation = calculator_observation(expression)
    answer = estimate(a, b) if observation.startswith("Error:") else observation
    return TeacherEpisode(mode, [call_text(expression), f"#### {answer}"], [observation])


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
