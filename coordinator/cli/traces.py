"""`meshrl trace RUN_ID STEP`: one step's trace from <run_dir>/traces.jsonl as a tree with durations, its
critical path marked (the chain of spans that ended last at each level: what the step waited for)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Span:
    """One line of traces.jsonl (services/common/tracing.span_record) with its children."""

    span_id: str
    parent_id: str | None
    name: str
    kind: str
    start_ns: int
    end_ns: int
    status: str
    attributes: dict
    children: list["Span"] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def trace_file(run: str, runs_dir: Path) -> Path:
    """RUN as a run directory, or a run id under runs_dir; ValueError names what is missing."""
    for d in (Path(run), runs_dir / run):
        if (d / "traces.jsonl").is_file():
            return d / "traces.jsonl"
    raise ValueError(f"run {run!r}: no traces.jsonl in {run} or {runs_dir / run} (is run.traces off, or is "
                     f"--runs-dir not the run's run.run_dir?)")


def load_step(path: Path, step: int) -> Span:
    """The root span of `step` (the last one recorded, when a resumed run redid the step) with its tree."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    roots = [r for r in records if r["parent_id"] is None and r["attributes"].get("meshrl.step") == step]
    if not roots:
        steps = sorted({r["attributes"]["meshrl.step"] for r in records
                        if r["parent_id"] is None and "meshrl.step" in r["attributes"]})
        raise ValueError(f"step {step}: not in {path} (traced steps: {_ranges(steps) or 'none'})")
    root = max(roots, key=lambda r: r["start_ns"])
    spans = {r["span_id"]: Span(**{k: r[k] for k in Span.__dataclass_fields__ if k != "children"})
             for r in records if r["trace_id"] == root["trace_id"]}
    for s in spans.values():
        if s.parent_id in spans:
            spans[s.parent_id].children.append(s)
    for s in spans.values():
        s.children.sort(key=lambda c: c.start_ns)
    return spans[root["span_id"]]


def _ranges(steps: list[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if len(steps) > 2 and steps[-1] - steps[0] == len(steps) - 1 else \
        ", ".join(map(str, steps))


def critical_path(root: Span) -> list[Span]:
    """From the root down, the child that ended last each time."""
    path = [root]
    while path[-1].children:
        path.append(max(path[-1].children, key=lambda c: c.end_ns))
    return path


def render(root: Span, *, width: int = 44) -> list[str]:
    """The tree, one line per span: name, start offset and duration; `*` marks the critical path."""
    on_path = {s.span_id for s in critical_path(root)}
    lines = [f"{root.name}  {root.seconds * 1e3:.1f} ms  (trace {root.attributes.get('meshrl.run_id', '')}, "
             f"* = critical path)"]

    def walk(span: Span, prefix: str) -> None:
        for i, child in enumerate(span.children):
            last = i == len(span.children) - 1
            label = f"{prefix}{'└─ ' if last else '├─ '}{child.name}"
            mark = "*" if child.span_id in on_path else " "
            status = "" if child.status in ("unset", "ok") else f"  [{child.status}]"
            lines.append(f"{label:<{width}} {mark} +{(child.start_ns - root.start_ns) / 1e6:8.1f} ms "
                         f"{child.seconds * 1e3:9.1f} ms{status}")
            walk(child, prefix + ("   " if last else "│  "))

    walk(root, "")
    path = critical_path(root)[1:]
    lines.append("critical path: " + " > ".join(f"{s.name} {s.seconds * 1e3:.1f} ms" for s in path))
    return lines


def print_step(run: str, step: int, runs_dir: Path, console) -> None:
    """`meshrl trace RUN STEP`: the rendered tree on `console`."""
    for line in render(load_step(trace_file(run, runs_dir), step)):
        console.print(line, highlight=False, soft_wrap=True)
