"""report.png from a run's metrics.jsonl: reward/accuracy, KL, entropy, response length (DPO: loss, implicit rewards,
log-probs, preference accuracy), step-time breakdown; for episodes, tool calls and turns per episode, tool errors."""

from __future__ import annotations

import json
from pathlib import Path

# Episode panels (agentic rollouts, docs/agentic.md), drawn in a third row when the metrics carry them.
EPISODE_PANELS = {"tool_calls_per_episode": "tool calls per episode", "turns_per_episode": "turns per episode",
                  "tool_error_rate": "tool error rate (errors / calls)"}
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
    episodic = [key for key in EPISODE_PANELS if any(key in m for m in steps)]
    fig, axes = plt.subplots(3 if episodic else 2, 3, figsize=(15, 12 if episodic else 8))
    dpo = any("dpo/loss" in m for m in steps)
    ax = axes[0, 0]
    ax.plot(x, [m["reward_mean"] for m in steps], label="train reward margin" if dpo else "train reward (mean)")
    ax.plot(x, [m.get("accuracy", float("nan")) for m in steps],
            label="train preference accuracy" if dpo else "train accuracy", alpha=0.7)
    if evals:
        ax.plot([m["step"] for m in evals], [m["heldout_accuracy"] for m in evals], "o-", label="held-out accuracy")
    ax.set_title("reward and accuracy")
    ax.legend()
    if dpo:
        # DPO has no rollouts in its steps: loss, implicit rewards, log-probs and held-out preference accuracy.
        panels = ((axes[0, 1], ("dpo/loss",), "DPO loss"),
                  (axes[0, 2], ("dpo/rewards/chosen", "dpo/rewards/rejected", "dpo/rewards/margins"), "implicit rewards"),
                  (axes[1, 0], ("dpo/logps/chosen", "dpo/logps/rejected"), "policy log-prob (summed)"),
                  (axes[1, 1], ("heldout_preference_accuracy", "heldout_logp_accuracy"), "held-out preference accuracy"))
    else:
        panels = ((axes[0, 1], ("kl",), "KL(actor || reference)"),
                  (axes[0, 2], ("actor/entropy",), "entropy"),
                  (axes[1, 0], ("response_length_mean",), "response length (tokens)"),
                  (axes[1, 1], ("rollout_vs_trainer/logprob_abs_diff",), "rollout vs trainer |dlogp|"))
    for ax, keys, title in panels:
        for key in keys:
            rows = evals if key.startswith("heldout_") else steps
            ax.plot([m["step"] for m in rows], [m.get(key, float("nan")) for m in rows],
                    "o-" if rows is evals else "-", label=key.split("/")[-1] if len(keys) > 1 else None)
        if len(keys) > 1:
            ax.legend(fontsize=7)
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
    if episodic:
        _episode_panels(axes[2], steps)
    for a in axes.flat:
        a.set_xlabel("step")
    fig.tight_layout()
    out = Path(out) if out else Path(run_dir) / "report.png"
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def _episode_panels(axes, steps: list[dict]) -> None:
    """One panel per episode metric: tool calls per episode, turns per episode, tool error rate."""
    for ax, (key, title) in zip(axes, EPISODE_PANELS.items()):
        ax.plot([m["step"] for m in steps], [m.get(key, float("nan")) for m in steps])
        ax.set_title(title)
