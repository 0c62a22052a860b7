"""report.png from a run's metrics.jsonl: reward/accuracy, KL, entropy, response length, step-time breakdown."""

from __future__ import annotations

import json
from pathlib import Path

PHASES = ("generate", "reward", "reference", "old_logprobs", "values", "train_critic", "train", "weight_sync")


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise ValueError(f"{path}: no metrics recorded")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    steps = [m for m in records if "reward_mean" in m]
    evals = [m for m in records if "heldout_accuracy" in m]
    x = [m["step"] for m in steps]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    ax = axes[0, 0]
    ax.plot(x, [m["reward_mean"] for m in steps], label="train reward (mean)")
    ax.plot(x, [m.get("accuracy", float("nan")) for m in steps], label="train accuracy", alpha=0.7)
    if evals:
        ax.plot([m["step"] for m in evals], [m["heldout_accuracy"] for m in evals], "o-", label="held-out accuracy")
    ax.set_title("reward and accuracy")
    ax.legend()
    for ax, key, title in ((axes[0, 1], "kl", "KL(actor || reference)"),
                           (axes[0, 2], "actor/entropy", "entropy"),
                           (axes[1, 0], "response_length_mean", "response length (tokens)"),
                           (axes[1, 1], "rollout_vs_trainer/logprob_abs_diff", "rollout vs trainer |dlogp|")):
        ax.plot(x, [m.get(key, float("nan")) for m in steps])
        ax.set_title(title)
    ax = axes[1, 2]
    bottom = [0.0] * len(steps)
    for phase in PHASES:
        vals = [m.get(f"time/{phase}", 0.0) for m in steps]
        if any(vals):
            ax.bar(x, vals, bottom=bottom, label=phase)
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_title("step time by phase (s; concurrent phases stack)")
    ax.legend(fontsize=7)
    for a in axes.flat:
        a.set_xlabel("step")
    fig.tight_layout()
    out = Path(out) if out else Path(run_dir) / "report.png"
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out
