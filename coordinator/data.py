"""Prompt datasets: JSONL or Parquet rows (verl's schema or plain prompt/answer), seeded epochs, a resumable position."""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

log = logging.getLogger("meshrl.data")


@dataclass(frozen=True)
class Problem:
    """One prompt of the dataset with what the reward needs."""

    id: str
    prompt: str                 # text handed to the rollout engine (chat template applied)
    ground_truth: str
    data_source: str


def read_rows(path: str) -> list[dict]:
    """Rows of a JSONL or Parquet file; a malformed JSONL line fails with the file and line number."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"data file {path!r} does not exist")
    if p.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"data file {path!r}: reading Parquet needs pyarrow (pip install pyarrow)") from None
        return pq.read_table(p).to_pylist()
    rows = []
    for n, line in enumerate(p.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"data file {path!r} line {n}: invalid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"data file {path!r} line {n}: a row must be a JSON object")
        rows.append(row)
    return rows


def _lookup(row: dict, dotted: str) -> Any:
    node: Any = row
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def row_to_problem(row: dict, index: int, *, prompt_key: str, answer_key: str, tokenizer=None,
                   apply_chat_template: bool = False, source: str = "data") -> Problem:
    """Accepts verl's rows (prompt as chat messages, reward_model.ground_truth) and plain prompt/answer rows."""
    prompt = _lookup(row, prompt_key)
    if prompt is None:
        raise ValueError(f"{source} row {index}: missing key {prompt_key!r} (data.prompt_key)")
    answer = _lookup(row, answer_key)
    if answer is None:
        answer = _lookup(row, "reward_model.ground_truth")
    if answer is None:
        raise ValueError(f"{source} row {index}: missing key {answer_key!r} (data.answer_key)")
    if isinstance(prompt, list):  # chat messages, verl's schema
        if tokenizer is None:
            raise ValueError(f"{source} row {index}: chat-message prompts need a tokenizer with a chat template")
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    elif isinstance(prompt, str):
        text = prompt
        if apply_chat_template and tokenizer is not None:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                 add_generation_prompt=True)
    else:
        raise ValueError(f"{source} row {index}: {prompt_key!r} must be a string or a list of chat messages")
    row_id = str(row.get("id", _lookup(row, "extra_info.index") if _lookup(row, "extra_info.index") is not None
                         else index))
    return Problem(id=row_id, prompt=text, ground_truth=str(answer), data_source=str(row.get("data_source", "")))


def load_problems(files: Sequence[str], *, prompt_key: str = "prompt", answer_key: str = "answer", tokenizer=None,
                  apply_chat_template: bool = False, max_prompt_tokens: int | None = None) -> list[Problem]:
    problems: list[Problem] = []
    for f in files:
        for i, row in enumerate(read_rows(f)):
            problems.append(row_to_problem(row, i, prompt_key=prompt_key, answer_key=answer_key, tokenizer=tokenizer,
                                           apply_chat_template=apply_chat_template, source=f"data file {f!r}"))
    if max_prompt_tokens and tokenizer is not None:
        kept = [p for p in problems if len(tokenizer(p.prompt)["input_ids"]) <= max_prompt_tokens]
        if len(kept) < len(problems):
            log.info("filtered %d of %d prompts longer than %d tokens", len(problems) - len(kept), len(problems),
                     max_prompt_tokens)
        problems = kept
    if not problems:
        raise ValueError(f"data: no rows in {list(files)}")
    return problems


class PromptStream:
    """Seeded shuffled epochs over problems; `position` (prompts consumed) is the resumable run state."""

    def __init__(self, problems: Sequence[Problem], *, seed: int, shuffle: bool = True, position: int = 0):
        self.problems = list(problems)
        self.seed = seed
        self.shuffle = shuffle
        self.position = position
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        """The epoch's permutation, computed once (a batch takes from at most two epochs; older ones go)."""
        order = self._orders.get(epoch)
        if order is None:
            order = list(range(len(self.problems)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}
            self._orders[epoch] = order
        return order

    def take(self, count: int) -> list[Problem]:
        """The next `count` problems; the position only moves when the caller commits it."""
        out, pos = [], self.position
        n = len(self.problems)
        while len(out) < count:
            epoch, offset = divmod(pos, n)
            out.append(self.problems[self._order(epoch)[offset]])
            pos += 1
        return out

    def advance(self, count: int) -> None:
        self.position += count

    @property
    def epoch(self) -> int:
        return self.position // len(self.problems)
