"""report.png from a run's metrics.jsonl: reward/accuracy, KL, entropy, response length, rollout-vs-trainer parity
(DPO: loss, implicit rewards, log-probs, preference accuracy), step-time breakdown; for episodes, tool calls and
turns per episode, tool errors. A metric logged on some steps only (the parity metric every
`algorithm.logprob_parity_every` steps, held-out accuracy every `run.eval_every`) is drawn as points at the steps
that have it; a panel none of whose metrics the run logged is left out."""

from __future__ import annotations

import json
import math
from pathlib import Path

# A panel: its title and its series, (metric key, legend label).
Panel = tuple[str, tuple[tuple[str, str], ...]]

RL_PANELS: tuple[Panel, ...] = (
    ("reward and accuracy", (("reward_mean", "train reward (mean)"), ("accuracy", "train accuracy"),
                             ("heldout_accuracy", "held-out accuracy"))),
    ("KL(actor || reference)", (("kl", "kl"),)),
    ("entropy", (("actor/entropy", "entropy"),)),
    ("response length (tokens)", (("response_length_mean", "mean"),)),
    ("rollout vs trainer |dlogp|", (("rollout_vs_trainer/logprob_abs_diff", "|dlogp|"),)),
    ("prompt groups with no reward variance", (("train/frac_zero_adv_groups", "fraction"),)),
)
# DPO has no rollouts in its steps: loss, implicit rewards, log-probs and held-out preference accuracy.
DPO_PANELS: tuple[Panel, ...] = (
    ("reward and accuracy", (("reward_mean", "train reward margin"), ("accuracy", "train preference accuracy"),
                             ("heldout_accuracy", "held-out accuracy"))),
    ("DPO loss", (("dpo/loss", "loss"),)),
    ("implicit rewards", (("dpo/rewards/chosen", "chosen"), ("dpo/rewards/rejected", "rejected"),
                          ("dpo/rewards/margins", "margins"))),
    ("policy log-prob (summed)", (("dpo/logps/chosen", "chosen"), ("dpo/logps/rejected", "rejected"))),
    ("held-out preference accuracy", (("heldout_preference_accuracy", "preference"),
                                      ("heldout_logp_accuracy", "log-prob"))),
)
# Episode panels (agentic rollouts, docs/agentic.md).
EPISODE_PANELS: tuple[Panel, ...] = (
    ("tool calls per episode", (("tool_calls_per_episode", "tool calls"),)),
    ("turns per episode", (("turns_per_episode", "turns"),)),
    ("tool error rate (errors / calls)", (("tool_error_rate", "error rate"),)),
)
PHASES = ("generate", "reward", "reference", "old_logprobs", "values", "train_critic", "train", "weight_sync")
TIME_TITLE = "step time by phase (s; concurrent phases stack)"
COLUMNS = 3


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise ValueError(f"{path}: no metrics recorded")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def points(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    """The steps that logged `key` with a finite value, and those values."""
    pairs = [(m["step"], m[key]) for m in records
             if isinstance(m.get(key), (int, float)) and math.isfinite(m[key])]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def figure(records: list[dict]):
    """The report as a matplotlib figure, one axes per panel that has values (titled as the panel)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m for m in records if "reward_mean" in m]
    panels = [p for p in (DPO_PANELS if any("dpo/loss" in m for m in steps) else RL_PANELS) + EPISODE_PANELS
              if any(points(records, key)[0] for key, _ in p[1])]
    timed = any(m.get(f"time/{phase}") for m in steps for phase in PHASES)
    num = max(1, len(panels) + timed)
    rows = math.ceil(num / COLUMNS)
    fig, axes = plt.subplots(rows, COLUMNS, figsize=(15, 4 * rows), squeeze=False)
    cells = list(axes.flat)
    for ax, (title, series) in zip(cells, panels):
        _draw(ax, records, len(steps), series)
        ax.set_title(title)
    if timed:
        _phase_bars(cells[len(panels)], steps)
    for ax in cells[len(panels) + timed:]:
        ax.remove()
    for ax in fig.axes:
        ax.set_xlabel("step")
    fig.tight_layout()
    return fig


def _draw(ax, records: list[dict], num_steps: int, series: tuple[tuple[str, str], ...]) -> None:
    """A series logged at every step is a line; one logged on fewer steps is points (joined), never a line with
    gaps that shows nothing between them."""
    drawn = 0
    for key, label in series:
        x, y = points(records, key)
        if not x:
            continue
        sparse = len(x) < num_steps or num_steps == 0
        ax.plot(x, y, marker="o" if sparse else None, markersize=4, linewidth=1.0 if sparse else 1.5, label=label)
        drawn += 1
    if drawn > 1:
        ax.legend(fontsize=7)


def _phase_bars(ax, steps: list[dict]) -> None:
    x = [m["step"] for m in steps]
    bottom = [0.0] * len(steps)
    for phase in PHASES:
        vals = [m.get(f"time/{phase}", 0.0) for m in steps]
        if any(vals):
            ax.bar(x, vals, bottom=bottom, label=phase)
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_title(TIME_TITLE)
    ax.legend(fontsize=7)


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """report.png (or `out`) of the run directory's metrics.jsonl."""
    fig = figure(read_metrics(run_dir))         # first: it picks the Agg backend before pyplot loads
    import matplotlib.pyplot as plt

    out = Path(out) if out else Path(run_dir) / "report.png"
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out
