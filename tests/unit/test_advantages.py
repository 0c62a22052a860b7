"""Advantage estimators against hand-computed values."""

import pytest
import torch

from coordinator.training.advantages import (AdaptiveKLController, gae_advantages, grpo_advantages, masked_whiten,
                                    reinforce_pp_advantages, reinforce_pp_baseline_advantages, rloo_advantages)


def _row_groups(rewards: torch.Tensor) -> torch.Tensor:
    """Group ids of [num_groups, group_size] rewards flattened row by row: one group per row."""
    return torch.arange(rewards.size(0)).repeat_interleave(rewards.size(1))


def _by_rows(estimator, rewards: torch.Tensor, **kwargs) -> torch.Tensor:
    """A per-sample group estimator on [num_groups, group_size] rewards, one group per row; same shape back."""
    return estimator(rewards.reshape(-1), _row_groups(rewards), **kwargs).reshape(rewards.shape)


def test_grpo_advantage_is_zero_when_all_rewards_equal():
    adv = _by_rows(grpo_advantages, torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]))
    assert torch.equal(adv, torch.zeros(2, 4))


def test_grpo_advantage_of_one_hand_computed_group():
    # mean 0.25; unbiased std of [1,0,0,0] = sqrt(0.75/3) = 0.5
    adv = _by_rows(grpo_advantages, torch.tensor([[1.0, 0.0, 0.0, 0.0]]), eps=0.0)
    assert torch.allclose(adv, torch.tensor([[1.5, -0.5, -0.5, -0.5]]))


def test_dr_grpo_advantage_is_mean_centred_without_std():
    adv = _by_rows(grpo_advantages, torch.tensor([[1.0, 0.0, 0.0, 0.0]]), norm_by_std=False)
    assert torch.allclose(adv, torch.tensor([[0.75, -0.25, -0.25, -0.25]]))


def test_rloo_subtracts_the_mean_of_the_other_samples():
    adv = _by_rows(rloo_advantages, torch.tensor([[1.0, 0.0, 2.0]]))
    # 1 - (0+2)/2 = 0 ; 0 - (1+2)/2 = -1.5 ; 2 - (1+0)/2 = 1.5
    assert torch.allclose(adv, torch.tensor([[0.0, -1.5, 1.5]]))


def test_rloo_rejects_groups_of_one():
    with pytest.raises(ValueError, match="rollout.n"):
        _by_rows(rloo_advantages, torch.tensor([[1.0]]))


def test_reinforce_pp_returns_are_whitened_reward_to_go():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = reinforce_pp_advantages(rewards, mask, gamma=1.0)
    # returns: [1, 1], [0, -] -> mean 2/3, var = (2*(1/3)^2 + (2/3)^2)/3 = 2/9
    std = (2 / 9) ** 0.5
    expected = torch.tensor([[1 / 3 / std, 1 / 3 / std], [-2 / 3 / std, 0.0]])
    assert torch.allclose(adv, expected, atol=1e-5)


def test_reinforce_pp_group_baseline_centres_each_group():
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    mask = torch.ones(4, 3)
    adv = reinforce_pp_baseline_advantages(rewards.reshape(-1), _row_groups(rewards), mask)
    # centred: [0.5, -0.5, 0, 0] per sequence; whitened over 12 tokens: mean 0, std sqrt(0.125)
    assert torch.allclose(adv[:, 0], torch.tensor([0.5, -0.5, 0.0, 0.0]) / 0.125 ** 0.5, atol=1e-4)


def test_gae_with_gamma_and_lambda_one_is_return_minus_value():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 0.5, 0.7]])
    mask = torch.ones(1, 3)
    adv, returns = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0, whiten=False)
    assert torch.allclose(adv, torch.tensor([[0.8, 0.5, 0.3]]))
    assert torch.allclose(returns, torch.tensor([[1.0, 1.0, 1.0]]))


def test_gae_hand_computed_with_discount():
    rewards = torch.tensor([[0.0, 1.0]])
    values = torch.tensor([[0.5, 0.4]])
    mask = torch.ones(1, 2)
    adv, _ = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5, whiten=False)
    d1 = 1.0 - 0.4                      # last token: no bootstrap
    d0 = 0.0 + 0.9 * 0.4 - 0.5
    assert torch.allclose(adv, torch.tensor([[d0 + 0.9 * 0.5 * d1, d1]]))


def test_gae_ignores_padding_after_the_response():
    rewards = torch.tensor([[1.0, 0.0, 0.0]])
    values = torch.tensor([[0.25, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0]])
    adv, _ = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0, whiten=False)
    assert torch.allclose(adv, torch.tensor([[0.75, 0.0, 0.0]]))


def test_masked_whiten_ignores_masked_entries():
    x = torch.tensor([[1.0, 3.0, 100.0]])
    out = masked_whiten(x, torch.tensor([[1.0, 1.0, 0.0]]))
    assert torch.allclose(out, torch.tensor([[-1.0, 1.0, 0.0]]), atol=1e-4)


def test_adaptive_kl_controller_raises_the_coefficient_above_target():
    ctl = AdaptiveKLController(0.1, target=0.05, horizon=100)
    assert ctl.update(0.5, num_samples=10) == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    assert ctl.update(0.0, num_samples=10) < 0.1 * 1.02
