"""Fills the figures of README.md, docs/ and bench/README.md from bench/results/*.json (`make bench-docs`).

A figure is written between marks that name its JSON and the value in it:

    <!-- fig: vs_trl_gpu:ratio_meshrl_over_trl.samples_per_s|{:.2f}x -->5.64x<!-- /fig -->

`FILE:PATH` — FILE is a stem under bench/results, PATH a dotted path (list indices as numbers, `*` for every
element; `P1 or P2` takes the first the file has); then `|`-separated steps: `min`, `max`, `median`, `len`, `pct` (x100), `ms` (x1000), `neg`, `gain` (x-1), `met` (a goal's true/false),
`over=PATH` (divided by another value of the same file), and a
final format (`{:.1f}`, applied to each element of a list, joined with ", "). A stale mark

    <!-- stale: trainer_mfu --><!-- /stale -->

is filled with a note when the code the JSON measures has changed since it was measured (bench/provenance.py).
`python bench/docs.py` rewrites the files; `--check` lists what differs and exits 1 (tests/unit/test_bench_figures.py).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.provenance import REPO, RESULTS, staleness  # noqa: E402

DOCS = ["README.md", "bench/README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]
# A mark quoted in backticks is an example, not a figure.
FIG = re.compile(r"(?<!`)<!-- fig: (?P<spec>[^>]*?) -->(?P<text>.*?)<!-- /fig -->", re.S)
STALE = re.compile(r"(?<!`)<!-- stale: (?P<stem>[\w.-]+) -->(?P<text>.*?)<!-- /stale -->", re.S)

_STEPS = {
    "min": min, "max": max, "median": statistics.median, "len": len,
    "pct": lambda v: [x * 100 for x in v] if isinstance(v, list) else v * 100,
    "ms": lambda v: [x * 1000 for x in v] if isinstance(v, list) else v * 1000,
    "neg": lambda v: [-x for x in v] if isinstance(v, list) else -v,
    "gain": lambda v: [x - 1 for x in v] if isinstance(v, list) else v - 1,
    "met": lambda v: "**met**" if v else "**not met**",
}


class FigureError(ValueError):
    pass


def _lookup(node, parts: list[str], spec: str):
    for i, part in enumerate(parts):
        if part == "*":
            if not isinstance(node, list):
                raise FigureError(f"{spec}: '*' needs a list")
            return [_lookup(x, parts[i + 1:], spec) for x in node]
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, ValueError, TypeError):
            raise FigureError(f"{spec}: no '{part}' in the JSON") from None
    return node


def _first(data, paths: list[str], spec: str):
    """The first of `a.b or c.d` that the file has (a key renamed between runs of a benchmark)."""
    for i, path in enumerate(paths):
        try:
            return _lookup(data, path.split(".") if path else [], spec)
        except FigureError:
            if i == len(paths) - 1:
                raise


def load(stem: str, cache: dict) -> dict:
    if stem not in cache:
        path = RESULTS / f"{stem}.json"
        if not path.exists():
            raise FigureError(f"bench/results/{stem}.json does not exist")
        cache[stem] = json.loads(path.read_text())
    return cache[stem]


def render(spec: str, cache: dict) -> str:
    """The text of one figure: `FILE:PATH|step|...|{format}`."""
    ref, *steps = [s.strip() for s in spec.split("|")]
    stem, _, paths = ref.partition(":")
    value = _first(load(stem, cache), paths.split(" or "), spec)
    fmt = "{}"
    for step in steps:
        if step in _STEPS:
            value = _STEPS[step](value)
        elif step.startswith("over="):  # a ratio of two values of the same file
            value = value / _lookup(load(stem, cache), step[5:].split("."), spec)
        elif "{" in step:
            fmt = step
        else:
            raise FigureError(f"{spec}: unknown step '{step}'")
    if isinstance(value, list):
        return ", ".join(fmt.format(v) for v in value)
    return fmt.format(value)


def stale_note(stem: str, cache: dict, old: str) -> str:
    stale, commit = staleness(stem, load(stem, cache))
    if stale is None:  # no git history here (a shallow copy): leave what the last full check wrote
        return old
    if not stale:
        return ""
    return f" *(stale: `{stem}.json` was measured at {commit}; the code it measures has changed since)*"


def fill(text: str, cache: dict, *, stale_marks: bool = True) -> str:
    """The text with every marked figure rendered from its JSON, and (stale_marks) every stale mark refreshed."""
    text = FIG.sub(lambda m: f"<!-- fig: {m['spec']} -->{render(m['spec'], cache)}<!-- /fig -->", text)
    if not stale_marks:
        return text
    return STALE.sub(lambda m: f"<!-- stale: {m['stem']} -->{stale_note(m['stem'], cache, m['text'])}"
                               f"<!-- /stale -->", text)


def differences(old: str, new: str) -> list[str]:
    olds, news = FIG.findall(old) + STALE.findall(old), FIG.findall(new) + STALE.findall(new)
    return [f"{spec}: doc says {a!r}, JSON gives {b!r}" for (spec, a), (_, b) in zip(olds, news) if a != b]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; list figures that differ, exit 1 if any")
    args = ap.parse_args(argv)
    cache: dict = {}
    bad = 0
    for rel in DOCS:
        path = REPO / rel
        old = path.read_text()
        new = fill(old, cache)
        if new == old:
            continue
        if args.check:
            for line in differences(old, new):
                print(f"{rel}: {line}")
            bad += 1
        else:
            path.write_text(new)
            print(f"bench-docs: filled {rel}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
