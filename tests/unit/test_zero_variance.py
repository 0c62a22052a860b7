"""`train/frac_zero_adv_groups`: the fraction of prompt groups with no reward variance (advantage 0 under the group
estimators), and the warning it raises once after N such steps in a row (coordinator/recipe/no_signal.py)."""

from types import SimpleNamespace

import numpy as np
import torch

from coordinator.recipe.config import AlgorithmConfig, RunSection
from coordinator.recipe.data import Problem
from coordinator.training.advantages import grpo_advantages, zero_variance_fraction
from coordinator.recipe.no_signal import METRIC, NoSignalWatch
from coordinator.training.phases import compute_advantages
from coordinator.training.remote import Sample


def test_the_fraction_counts_the_groups_whose_rewards_are_all_equal_wherever_their_samples_sit():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.5])
    groups = torch.tensor([0, 1, 0, 1, 2, 2, 3, 3])   # group 0 varies; 1 (0, 0), 2 (1, 1), 3 (.5, .5) do not
    assert zero_variance_fraction(rewards, groups) == 0.75
    # The groups it counts are exactly those GRPO gives advantage 0.
    adv = grpo_advantages(rewards, groups)
    assert [bool((adv[groups == g] == 0).all()) for g in range(4)] == [False, True, True, True]


def test_a_difference_below_the_tolerance_is_no_variance_and_one_above_it_is():
    groups = torch.tensor([0, 0])
    assert zero_variance_fraction(torch.tensor([0.3, 0.1 + 0.2]), groups) == 1.0
    assert zero_variance_fraction(torch.tensor([0.3, 0.31]), groups) == 0.0


def test_with_one_sample_per_prompt_the_batch_is_the_group():
    groups = torch.arange(4)
    assert zero_variance_fraction(torch.zeros(4), groups) == 1.0
    assert zero_variance_fraction(torch.tensor([0.0, 0.0, 1.0, 0.0]), groups) == 0.0


def _samples(rewards: list[list[float]]) -> list[Sample]:
    out = []
    for g, row in enumerate(rewards):
        problem = Problem(id=f"q{g}", prompt=f"{g}+1=", ground_truth=str(g + 1), data_source="arith")
        out += [Sample(problem, g, np.array([1, 2], np.int32), np.arange(3, dtype=np.int32),
                       np.full(3, -0.5, np.float32), "", "stop", 0, reward=r) for r in row]
    return out


def test_compute_advantages_reports_the_fraction_in_the_step_metrics():
    ctx = SimpleNamespace(cfg=SimpleNamespace(algorithm=AlgorithmConfig()), kl_coef=0.0, kl_controller=None)
    metrics = compute_advantages(ctx, _samples([[0.0, 0.0, 0.0], [1.0, 0.0, 1.0], [1.0, 1.0, 1.0], [0.0, 1.0, 0.0]]))
    assert metrics[METRIC] == 0.5
    metrics = compute_advantages(ctx, _samples([[0.0, 0.0], [0.0, 0.0]]))
    assert metrics[METRIC] == 1.0 and metrics["advantage_abs_mean"] == 0.0


def test_the_warning_comes_once_after_n_steps_in_a_row_and_names_what_to_check():
    watch = NoSignalWatch(3)
    records = [{"step": 1, METRIC: 1.0}, {"step": 2, METRIC: 1.0}, {"step": 3, METRIC: 0.5},  # the run of 2 breaks
               {"step": 4, METRIC: 1.0}, {"step": 5, METRIC: 1.0},
               {"step": 5, "heldout_accuracy": 0.0},    # an evaluation record leaves the count as it is
               {"step": 6, METRIC: 1.0}, {"step": 7, METRIC: 1.0}, {"step": 8, METRIC: 0.0}, {"step": 9, METRIC: 1.0},
               {"step": 10, METRIC: 1.0}, {"step": 11, METRIC: 1.0}]
    said = [watch.update(m) for m in records]
    assert [i for i, line in enumerate(said) if line] == [6]    # step 6, the third in a row; never again
    for words in ("3 steps in a row", "reward function", "ground truth", "rollout.n", "rollout.temperature",
                  "rollout.max_tokens"):
        assert words in said[6]


def test_zero_steps_turns_the_warning_off_and_three_is_the_default():
    watch = NoSignalWatch(0)
    assert all(watch.update({METRIC: 1.0}) is None for _ in range(10))
    assert RunSection().zero_variance_warn_steps == 3
