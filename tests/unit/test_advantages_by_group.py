"""Advantages follow each sample's group id, not its place in the batch; the registries name what the config accepts."""

import random
import typing
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from coordinator.recipe.config import AlgorithmConfig
from coordinator.recipe.data import Problem
from coordinator.training.advantages import ADVANTAGE_ESTIMATORS, grpo_advantages, rloo_advantages
from coordinator.training.algorithms import ALGORITHMS
from coordinator.training.phases import compute_advantages
from coordinator.training.remote import Sample


def _samples(num_groups: int, n: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for g in range(num_groups):
        problem = Problem(id=f"q{g}", prompt=f"{g}+1=", ground_truth=str(g + 1), data_source="arith")
        for _ in range(n):
            length = rng.randint(1, 5)
            out.append(Sample(problem, g, np.array([1, 2], dtype=np.int32), np.arange(length, dtype=np.int32),
                              np.full(length, -0.5, dtype=np.float32), "", "stop", 0,
                              reward=float(rng.randint(0, 3)), values=[rng.random() for _ in range(length)],
                              ref_logprobs=[-rng.random() for _ in range(length)]))   # distill's teacher
    return out


def _fill_advantages(estimator: str, samples: list[Sample]) -> None:
    """compute_advantages on a context that holds only what it reads."""
    ctx = SimpleNamespace(cfg=SimpleNamespace(algorithm=AlgorithmConfig(adv_estimator=estimator)), kl_coef=0.0,
                          kl_controller=None)
    compute_advantages(ctx, samples)


@pytest.mark.parametrize("estimator", sorted(ADVANTAGE_ESTIMATORS))
def test_shuffled_samples_get_the_same_per_sample_advantages(estimator):
    ordered = _samples(num_groups=4, n=3)
    shuffled = list(ordered)
    random.Random(1).shuffle(shuffled)
    assert [s.group for s in shuffled] != [s.group for s in ordered]
    _fill_advantages(estimator, ordered)
    want = [np.array(s.advantages) for s in ordered]
    _fill_advantages(estimator, shuffled)
    for s, w in zip(ordered, want):
        assert np.allclose(s.advantages, w, atol=1e-6), (estimator, s.id)


def test_grpo_normalises_a_short_group_by_its_own_samples():
    # Group 7 lost a sample: its two rewards are normalised between themselves, group 3 is unaffected.
    rewards = torch.tensor([1.0, 0.0, 5.0, 0.0, 3.0])
    groups = torch.tensor([3, 3, 7, 3, 7])
    adv = grpo_advantages(rewards, groups, eps=0.0)
    std3, std7 = torch.tensor([1.0, 0.0, 0.0]).std(), torch.tensor([5.0, 3.0]).std()
    want = torch.tensor([(1 - 1 / 3) / std3, -1 / 3 / std3, 1 / std7, -1 / 3 / std3, -1 / std7])
    assert torch.allclose(adv, want)


def test_rloo_baseline_of_a_short_group_averages_its_other_samples_only():
    adv = rloo_advantages(torch.tensor([1.0, 4.0, 0.0, 2.0, 6.0]), torch.tensor([0, 1, 0, 0, 1]))
    assert torch.allclose(adv, torch.tensor([1 - 1.0, 4 - 6.0, 0 - 1.5, 2 - 0.5, 6 - 4.0]))


def test_the_estimator_registry_holds_exactly_the_configs_adv_estimators():
    accepted = typing.get_args(AlgorithmConfig.model_fields["adv_estimator"].annotation)
    assert set(ADVANTAGE_ESTIMATORS) == set(accepted)


def test_the_algorithm_registry_holds_exactly_the_configs_kinds():
    accepted = typing.get_args(AlgorithmConfig.model_fields["kind"].annotation)
    assert set(ALGORITHMS) == set(accepted)
