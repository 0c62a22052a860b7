"""The warning, once per run, when no prompt group had any reward variance for N steps in a row
(`run.zero_variance_warn_steps`): every advantage is then 0 under the group estimators and the updates teach
nothing, so it names the recipe's keys to check. Read off the step metrics (`train/frac_zero_adv_groups`,
coordinator/training/phases.py) by the run manager, which logs it, and by `meshrl up` / `meshrl run`, which print it
under their step lines. Also the once-per-run line for a step that dynamic sampling (algorithm.filter_groups) left
short. Here, beside the recipe, since the CLI reaches no training code; no torch."""

from __future__ import annotations

METRIC = "train/frac_zero_adv_groups"


def warning(steps: int) -> str:
    """The warning's one line: what happened, and what to check."""
    return (f"warning: no prompt group had any reward variance for {steps} steps in a row ({METRIC} = 1): every "
            f"advantage is 0 and the updates teach nothing. Check the reward function and its ground truth "
            f"(samples.jsonl has each response, its reward and ground_truth), rollout.n (samples per prompt), "
            f"rollout.temperature, and rollout.max_tokens (responses cut short: finish_reason 'length' in "
            f"samples.jsonl)")


class NoSignalWatch:
    """Counts the consecutive steps whose groups all had zero reward variance; `update` returns the warning on
    the step the count reaches `steps`, once (0 turns it off). Records without the metric (held-out evaluations,
    DPO steps) leave the count as it is."""

    def __init__(self, steps: int):
        self.steps = steps
        self.run = 0
        self.warned = False

    def update(self, metrics: dict) -> str | None:
        value = metrics.get(METRIC)
        if value is None:
            return None
        self.run = self.run + 1 if value >= 1.0 else 0
        if self.steps and not self.warned and self.run >= self.steps:
            self.warned = True
            return warning(self.steps)
        return None


SHORT = "train/num_groups_short"


class ShortBatchWatch:
    """algorithm.filter_groups (coordinator/training/dynamic_sampling.py): `update` returns one line, once, for the
    first step that reached max_num_gen_batches without data.rollout_batch_size groups with reward variance."""

    def __init__(self):
        self.warned = False

    def update(self, metrics: dict) -> str | None:
        short = metrics.get(SHORT)
        if not short or self.warned:
            return None
        self.warned = True
        return (f"warning: step {int(metrics['step'])} reached algorithm.filter_groups.max_num_gen_batches="
                f"{int(metrics.get('train/num_gen_batches', 0))} with {int(short)} groups with reward variance fewer "
                f"than data.rollout_batch_size; it trained on the {int(metrics.get('train/num_groups', 0))} groups "
                f"it had (verl stops the run here). Later short steps count in {SHORT}; raise max_num_gen_batches "
                f"to keep batches full")
