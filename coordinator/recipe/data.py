"""Prompt datasets: JSONL or Parquet rows (verl's schema or plain prompt/answer), chat prompts rendered to token ids
once, seeded epochs, a resumable position."""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

log = logging.getLogger("meshrl.data")


# verl's row schema: the prompt (data.prompt_key), the reward's key (data.reward_fn_key), and these.
VERL_COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")


@dataclass(frozen=True)
class Problem:
    """One prompt of the dataset with what the reward needs; every field of a verl row is kept."""

    id: str
    prompt: str                 # the prompt as text (chat template applied): the reward's `prompt`, the records'
    ground_truth: str
    data_source: str            # the row's data.reward_fn_key value (verl: data_source): picks the reward
    # Token ids the rollout generates from: a chat prompt's template rendered once (one BOS, generation prompt
    # added); empty for a plain text prompt, which the rollout tokenizes itself.
    prompt_ids: tuple[int, ...] = ()
    ability: str = ""
    reward_style: str = ""      # reward_model.style
    # The row's extra_info (verl), handed to the reward function and written to the sample records.
    extra_info: dict = field(default_factory=dict, compare=False)
    # The chat messages of a chat prompt ([] for plain text): a multi-turn episode's replica renders them with the
    # tools (GenerateEpisodes). verl's `agent_name` column picks the row's agent loop ("" = rollout.agent.name).
    messages: tuple = field(default=(), compare=False)
    agent_name: str = ""


def read_rows(path: str) -> list[dict]:
    """Rows of a JSONL or Parquet file; a malformed JSONL line fails with the file and line number."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"data file {path!r} does not exist")
    if p.suffix == ".parquet":
        return read_parquet(path).to_pylist()
    return [_json_row(path, n, line) for n, line in enumerate(p.read_text().splitlines(), start=1) if line.strip()]


def first_row(path: str) -> dict:
    """A JSONL file's first row, read alone (a preflight look at a file the run reads whole)."""
    with open(path, errors="replace") as f:
        for n, line in enumerate(f, start=1):
            if line.strip():
                return _json_row(path, n, line)
    raise ValueError(f"data file {path!r} has no rows")


def _json_row(path: str, n: int, line: str) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        # A .csv, a pretty-printed .json or a text file reads as JSONL too: say what a data file is.
        raise ValueError(f"data file {path!r} line {n}: invalid JSON ({e.msg}); a data file is JSON Lines (one "
                         f"JSON object a line) or .parquet") from None
    if not isinstance(row, dict):
        raise ValueError(f"data file {path!r} line {n}: a row must be a JSON object")
    return row


def read_parquet(path: str, *, schema_only: bool = False):
    """The file's table, or with schema_only its schema alone (no row is read)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"data file {path!r}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    try:
        return pq.read_schema(path) if schema_only else pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - pyarrow's errors name no file
        raise ValueError(f"data file {path!r}: not a readable Parquet file ({type(e).__name__}: {e})") from None


def check_columns(path: str, columns: Sequence[str], *, prompt_key: str, answer_key: str) -> None:
    """A Parquet file has a column for the prompt and one for the answer (or verl's reward_model)."""
    names = set(columns)
    have = ", ".join(columns)
    if prompt_key.split(".")[0] not in names:
        raise ValueError(f"data file {path!r}: no column {prompt_key.split('.')[0]!r} for the prompt "
                         f"(data.prompt_key: {prompt_key}); its columns: {have}")
    if answer_key.split(".")[0] not in names and "reward_model" not in names:
        raise ValueError(f"data file {path!r}: no column 'reward_model' (verl's reward_model.ground_truth) nor "
                         f"{answer_key.split('.')[0]!r} (data.answer_key) for the answer; its columns: {have}")


def _lookup(row: dict, dotted: str) -> Any:
    node: Any = row
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


def render_chat(tokenizer, messages: list[dict]) -> tuple[str, tuple[int, ...]]:
    """The chat template applied once: (its text, its token ids), generation prompt added. The text holds the
    template's own special tokens (its BOS), so it is encoded without adding any: exactly one BOS."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    bos = getattr(tokenizer, "bos_token_id", None)
    while bos is not None and len(ids) > 1 and ids[0] == bos and ids[1] == bos:   # a template that adds it twice
        ids.pop(0)
    return text, tuple(int(t) for t in ids)


def _prompt(row: dict, where: str, prompt_key: str, tokenizer, apply_chat_template: bool
            ) -> tuple[str, tuple[int, ...], list[dict]]:
    """The row's prompt as (text, token ids, chat messages); ids and messages are empty for a plain text prompt
    left to the rollout."""
    prompt = _lookup(row, prompt_key)
    if isinstance(prompt, str):
        if not apply_chat_template or tokenizer is None:
            return prompt, (), []
        prompt = [{"role": "user", "content": prompt}]
    elif not (isinstance(prompt, list) and prompt and all(_is_message(m) for m in prompt)):
        raise ValueError(f"{where}: {prompt_key!r} must be a string or a list of chat messages "
                         f"({{role, content}} strings), got {type(prompt).__name__} {str(prompt)[:80]!r}")
    if tokenizer is None:
        raise ValueError(f"{where}: chat-message prompts need a tokenizer with a chat template")
    return (*render_chat(tokenizer, prompt), [dict(m) for m in prompt])


def check_row_keys(row: dict, where: str, *, prompt_key: str, answer_key: str) -> Any:
    """The row holds a prompt at data.prompt_key and an answer at data.answer_key (or verl's
    reward_model.ground_truth); -> the answer."""
    if _lookup(row, prompt_key) is None:
        raise ValueError(f"{where}: missing key {prompt_key!r} (data.prompt_key)")
    answer = _lookup(row, answer_key)
    if answer is None:
        answer = _lookup(row, "reward_model.ground_truth")
    if answer is None:
        raise ValueError(f"{where}: missing key {answer_key!r} (data.answer_key) and reward_model.ground_truth")
    return answer


def row_to_problem(row: dict, index: int, *, prompt_key: str, answer_key: str, tokenizer=None,
                   apply_chat_template: bool = False, source: str = "data", reward_fn_key: str = "data_source"
                   ) -> Problem:
    """Accepts verl's rows (prompt as chat messages, reward_model.ground_truth, extra_info) and plain
    prompt/answer rows; every error names the file and row."""
    where = f"{source} row {index}"
    answer = check_row_keys(row, where, prompt_key=prompt_key, answer_key=answer_key)
    text, ids, messages = _prompt(row, where, prompt_key, tokenizer, apply_chat_template)
    extra_info = row.get("extra_info") or {}
    if not isinstance(extra_info, dict):
        raise ValueError(f"{where}: extra_info must be a mapping, got {type(extra_info).__name__}")
    index_in_extra = extra_info.get("index")
    row_id = str(row.get("id", index_in_extra if index_in_extra is not None else index))
    key = _lookup(row, reward_fn_key)
    return Problem(id=row_id, prompt=text, ground_truth=str(answer), data_source="" if key is None else str(key),
                   prompt_ids=ids, ability=str(row.get("ability") or ""),
                   reward_style=str(_lookup(row, "reward_model.style") or ""), extra_info=dict(extra_info),
                   messages=tuple(messages), agent_name=str(row.get("agent_name") or ""))


@dataclass
class Dataset:
    """The problems of a run's files, how many overlong prompts were dropped, and where each data_source (the
    reward_fn_key value) was first seen, for errors."""

    problems: list[Problem]
    num_overlong_dropped: int = 0
    sources: dict[str, str] = field(default_factory=dict)


def _prompt_length(problem: Problem, tokenizer) -> int:
    return len(problem.prompt_ids) if problem.prompt_ids else len(tokenizer(problem.prompt)["input_ids"])


def load_dataset(files: Sequence[str], *, key: str = "data", **kwargs) -> Dataset:
    """Every row of `files` (the recipe's `key`) as a Problem; an error about a file starts with `key`."""
    try:
        out = _load_rows(files, **kwargs)
    except ValueError as e:
        if str(e).startswith("data file "):
            raise ValueError(f"{key}: {e}") from None
        raise
    if not out.problems:
        raise ValueError(f"{key}: no rows in {list(files)}")
    return out


def _load_rows(files: Sequence[str], *, prompt_key: str = "prompt", answer_key: str = "answer",
               reward_fn_key: str = "data_source", tokenizer=None, apply_chat_template: bool = False,
               max_prompt_tokens: int | None = None, filter_overlong: bool = False) -> Dataset:
    """A prompt longer than `max_prompt_tokens` is refused naming its row, or dropped and counted with
    `filter_overlong` (verl's data.filter_overlong_prompts)."""
    out = Dataset([])
    for f in files:
        source = f"data file {f!r}"
        if Path(f).suffix == ".parquet" and Path(f).is_file():
            table = read_parquet(f)
            check_columns(f, table.column_names, prompt_key=prompt_key, answer_key=answer_key)
            rows = table.to_pylist()
        else:
            rows = read_rows(f)
        for i, row in enumerate(rows):
            p = row_to_problem(row, i, prompt_key=prompt_key, answer_key=answer_key, tokenizer=tokenizer,
                               apply_chat_template=apply_chat_template, source=source, reward_fn_key=reward_fn_key)
            if max_prompt_tokens and tokenizer is not None and (n := _prompt_length(p, tokenizer)) > max_prompt_tokens:
                if not filter_overlong:
                    raise ValueError(f"data.max_prompt_length: {source} row {i}: the prompt is {n} tokens, over "
                                     f"{max_prompt_tokens} (set data.filter_overlong_prompts: true to drop such rows)")
                out.num_overlong_dropped += 1
                continue
            out.sources.setdefault(p.data_source, f"{source} row {i}")
            out.problems.append(p)
    if out.num_overlong_dropped:
        log.info("dropped %d prompts longer than %d tokens (data.filter_overlong_prompts)", out.num_overlong_dropped,
                 max_prompt_tokens)
    return out


def load_problems(files: Sequence[str], **kwargs) -> list[Problem]:
    """The problems of `files` (load_dataset's keywords)."""
    return load_dataset(files, **kwargs).problems


class PromptStream:
    """Seeded shuffled epochs over problems; `position` (prompts consumed) is the resumable run state."""

    def __init__(self, problems: Sequence[Problem], *, seed: int, shuffle: bool = True, position: int = 0,
                 num_dropped: int = 0):
        self.problems = list(problems)
        # Rows left out when loading (overlong prompts), reported with every step's metrics.
        self.num_dropped = num_dropped
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

    def take(self, count: int, at: int | None = None) -> list[Problem]:
        """The next `count` problems (from position `at`, default the current one); the position only moves when the
        caller commits it."""
        out, pos = [], self.position if at is None else at
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
