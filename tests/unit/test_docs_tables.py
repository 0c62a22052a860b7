"""The docs' tables of keys and defaults say what the config models say: each (key, default) row of docs/*.md is read
against the pydantic defaults (coordinator/recipe/config.py and the services' config.py), and each key whose
config takes a fixed set of values names every one of them in its row."""

from __future__ import annotations

import re
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import pytest
import yaml
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from coordinator.recipe.config import RunConfig

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))
# `key: value` in a heading names the section a table's keys sit in: "### `actor:`", "## Config: the `rollout:`".
SECTION = re.compile(r"`([a-z_.]+):`")
UNITS = {"KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30}
# A cell that names no fixed value: another key, the model's own size, a choice made at start.
DERIVED = (None, "auto", "")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _tables(path: Path):
    """(heading, header cells, rows) of each markdown table in a doc."""
    heading, lines = "", path.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("#"):
            heading = lines[i]
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|[-| :]+\|$", lines[i + 1].strip()):
            header, rows, i = _cells(lines[i]), [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            yield heading, header, rows
            continue
        i += 1


def _split(cell: str) -> list[str]:
    """Comma-separated parts, commas inside brackets kept."""
    parts, depth, cur = [], 0, ""
    for ch in cell:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [*parts, cur.strip()]


def _keys(cell: str) -> list[str]:
    """`lr`, `weight_decay` -> both; `python.timeout_s`, `cpu_s` -> python.timeout_s, python.cpu_s."""
    names = [p.strip("`") for p in _split(cell)]
    if not all(re.fullmatch(r"[a-z_][a-z0-9_.]*", n) for n in names):
        return []
    parent = names[0].rpartition(".")[0]
    return [names[0], *[f"{parent}.{n}" if parent and "." not in n else n for n in names[1:]]]


def documented_defaults() -> list[tuple[str, str, str]]:
    """(doc:line-ish, full key, default cell) of every key-and-default table row."""
    out = []
    for doc in DOCS:
        for heading, header, rows in _tables(doc):
            if len(header) < 2 or not header[0].startswith("key") or header[1] != "default":
                continue
            full = "(config)" in header[0]
            match = SECTION.search(heading)
            if not full and match is None:
                continue
            prefix = "" if full else match.group(1) + "."
            for row in rows:
                keys, cell = _keys(row[0]), row[1]
                if not keys or not cell:
                    continue
                values = _split(cell) if len(keys) > 1 and len(_split(cell)) == len(keys) else [cell] * len(keys)
                out += [(f"{doc.name} {heading.strip('# ')}", prefix + k, v) for k, v in zip(keys, values)]
    return out


def _field(dotted: str):
    """The pydantic FieldInfo and annotation of a dotted key of RunConfig, or None."""
    model: Any = RunConfig
    info = None
    for part in dotted.split("."):
        model = _model_of(model)
        if model is None or part not in model.model_fields:
            return None
        info = model.model_fields[part]
        model = info.annotation
    return info


def _model_of(tp: Any):
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp
    if get_origin(tp) in (Union, types.UnionType):
        return next((m for m in map(_model_of, get_args(tp)) if m is not None), None)
    return None


def config_default(info) -> Any:
    if info.default_factory is not None:
        value = info.default_factory()
    else:
        value = None if info.default is PydanticUndefined else info.default
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return list(value) if isinstance(value, tuple) else value


def _scalar(token: str) -> Any:
    """A YAML 1.2 scalar: numbers (`1e-6` too), true/false/null, lists and mappings; any other word is a string
    (`off` stays `off`)."""
    if re.fullmatch(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?", token):
        return float(token) if re.search(r"[.eE]", token) else int(token)
    if token in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[token]
    if token[:1] in "([{":
        return yaml.safe_load(token.replace("(", "[").replace(")", "]"))
    return token


def parse_cell(cell: str, key: str) -> tuple[bool, Any]:
    """(True, value) for a cell that states one value; (False, None) for one that derives it (another key, auto,
    a sentence)."""
    text = cell.strip()
    unit = re.fullmatch(r"([0-9.]+)\s*(KiB|MiB|GiB)", text)
    if unit:
        return True, float(unit.group(1)) * UNITS[unit.group(2)]
    head = re.match(r"^(`[^`]*`|\([^)]*\)|\[[^\]]*\]|[^\s:=;(]+)(.*)$", text)
    if head is None or "..." in text:
        return False, None
    token, rest = head.group(1).strip("`"), head.group(2).strip()
    if rest and not re.match(r"^(=|:|\(|;)", rest):
        return False, None                      # "2 for `interleaved_1f1b`, else 1", "`float32` when ..."
    sibling = f"{key.rpartition('.')[0]}.{token}" if "." in key else token
    named = re.fullmatch(r"[a-z_][a-z0-9_.]*", token) and ("." in token or _field(sibling) is not None)
    if token in ("auto", "absent") or named:
        return False, None                      # auto, or another key (`model.path`, `pp_size`)
    if token == "none" and not head.group(1).startswith("`"):
        return True, None                       # a bare none is null; `none` is the string
    return True, _scalar(token)


def _same(doc: Any, cfg: Any) -> bool:
    if isinstance(doc, (int, float)) and not isinstance(doc, bool) and isinstance(cfg, (int, float)):
        return abs(doc - cfg) <= 1e-12 * max(1.0, abs(cfg))
    if isinstance(doc, list) and isinstance(cfg, list):
        return len(doc) == len(cfg) and all(_same(a, b) for a, b in zip(doc, cfg))
    if doc is None and cfg in ("none", "null"):
        return True
    return doc == cfg or (isinstance(doc, str) and str(cfg) == doc)


ROWS = documented_defaults()


def test_the_docs_have_tables_of_defaults_to_check():
    # The parser finds the tables: an empty walk would pass everything below.
    docs = {where.split()[0] for where, _, _ in ROWS}
    assert {"rollout.md", "trainer.md", "agentic.md", "reference.md", "dpo.md"} <= docs and len(ROWS) > 60


def test_every_documented_key_exists():
    missing = [f"{where}: {key}" for where, key, _ in ROWS if _field(key) is None]
    assert missing == []


def test_every_documented_default_is_the_configs():
    wrong = []
    for where, key, cell in ROWS:
        info = _field(key)
        if info is None:
            continue
        stated, value = parse_cell(cell, key)
        have = config_default(info)
        if isinstance(have, dict) and have and not stated:
            continue                            # a nested section, its keys in a table of their own
        if stated and not _same(value, have):
            wrong.append(f"{where}: {key}: docs {cell!r}, config {have!r}")
        elif not stated and have not in DERIVED and not (isinstance(have, str) and have == "auto"):
            wrong.append(f"{where}: {key}: docs {cell!r} (derived), config {have!r}")
    assert wrong == []


def _choices(tp: Any) -> list[str]:
    if get_origin(tp) is Literal:
        return [str(a) for a in get_args(tp)]
    if get_origin(tp) in (Union, types.UnionType):
        return [c for a in get_args(tp) for c in _choices(a)]
    return []


def test_every_choice_a_key_takes_is_named_in_its_row():
    unnamed = []
    for doc in DOCS:
        for heading, header, rows in _tables(doc):
            if len(header) < 3 or not header[0].startswith("key") or header[1] != "default":
                continue
            match, full = SECTION.search(heading), "(config)" in header[0]
            prefix = "" if full else (match.group(1) + "." if match else None)
            for row in rows if prefix is not None else []:
                for key in _keys(row[0]):
                    info = _field(prefix + key)
                    choices = [c for c in _choices(info.annotation) if c != "auto"] if info else []
                    text = " ".join(row[1:])
                    unnamed += [f"{doc.name}: {prefix}{key}: {c!r}" for c in choices
                                if f"`{c}`" not in text and not re.search(rf"(^|\W){re.escape(c)}(\W|$)", row[1])]
    assert unnamed == []


@pytest.mark.parametrize("cell, value", [("1", 1), ("`[]` = all", []), ("4 MiB", 4 * 2 ** 20), ("null", None),
                                         ("`none`", "none"), ("none", None), ("(0.9, 0.999)", [0.9, 0.999])])
def test_a_stated_default_cell_reads_as_its_value(cell, value):
    assert parse_cell(cell, "k") == (True, value)


@pytest.mark.parametrize("cell", ["`model.path`", "auto: on for CUDA", "2 for `interleaved_1f1b`, else 1", "absent",
                                  "`float32` when `model.dtype` is `bfloat16`"])
def test_a_derived_default_cell_states_no_value(cell):
    assert parse_cell(cell, "k")[0] is False


# Tables whose rows are the values one key takes, by (doc, first header cell): every value the config takes is a
# row, the row marked (default) is the config's default, and a row's (`true`) / `false` spelling loads as it.
VALUE_TABLES = {("weight_sync.md", "transport"): "weight_sync.transport",
                ("trainer.md", "mode"): "actor.activation_checkpointing"}


@pytest.mark.parametrize("doc, header, key", [(d, h, k) for (d, h), k in VALUE_TABLES.items()])
def test_a_table_of_values_lists_what_the_config_takes(doc, header, key):
    from services.common.config import load_config

    rows = next(rows for _, head, rows in _tables(ROOT / "docs" / doc) if head[0] == header)
    values = {re.match(r"`([^`]+)`", row[0]).group(1): row[0] for row in rows}
    info = _field(key)
    assert sorted(values) == sorted(_choices(info.annotation))
    assert [v for v, cell in values.items() if "default" in cell] == [config_default(info)]
    for value, cell in values.items():
        for spelling in re.findall(r"`(true|false)`", cell):
            cfg = load_config(RunConfig, overrides={key: spelling})
            section, _, leaf = key.partition(".")
            assert getattr(getattr(cfg, section), leaf) == value
