"""Hand-computed values of the trainer's policy, value, KL and entropy losses and their aggregation."""

import math

import pytest
import torch

from services.trainer.updates.losses import (aggregate, clipped_policy_loss, clipped_value_loss, entropy_from_logits,
                                             kl_penalty, num_units)


def _policy(ratios, advs, **kw):
    ratio = torch.tensor([ratios], dtype=torch.float64)
    adv = torch.tensor([advs], dtype=torch.float64)
    kw.setdefault("clip_ratio_low", 0.2)
    kw.setdefault("clip_ratio_high", 0.2)
    loss, clipped = clipped_policy_loss(ratio.log(), torch.zeros_like(ratio), adv, **kw)
    return loss[0].tolist(), clipped[0].tolist()


def test_policy_loss_inside_the_clip_range_is_minus_ratio_times_advantage():
    loss, clipped = _policy([1.1, 0.9], [1.0, -2.0])
    assert loss == pytest.approx([-1.1, 1.8])
    assert clipped == [0.0, 0.0]


def test_policy_loss_clips_ratios_above_the_range_for_positive_advantages():
    loss, clipped = _policy([1.5], [1.0])
    assert loss == pytest.approx([-1.2])
    assert clipped == [1.0]


def test_policy_loss_keeps_the_pessimistic_unclipped_term_outside_the_range():
    # ratio 0.5 with A>0 and ratio 1.5 with A<0 are worse than their clipped versions: no clipping.
    loss, clipped = _policy([0.5, 1.5], [1.0, -1.0])
    assert loss == pytest.approx([-0.5, 1.5])
    assert clipped == [0.0, 0.0]


def test_policy_loss_clips_ratios_below_the_range_for_negative_advantages():
    loss, clipped = _policy([0.5], [-1.0])
    assert loss == pytest.approx([0.8])
    assert clipped == [1.0]


def test_clip_higher_widens_only_the_upper_bound():
    loss, clipped = _policy([1.25, 0.7], [1.0, -1.0], clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert loss == pytest.approx([-1.25, 0.8])
    assert clipped == [0.0, 1.0]


def test_dual_clip_bounds_the_loss_of_negative_advantages_at_c_times_advantage():
    loss, clipped = _policy([5.0, 2.0, 5.0], [-1.0, -1.0, 1.0], clip_ratio_c=3.0)
    # ratio 5, A=-1: max(5, 1.2) = 5, bounded by 3; ratio 2: 2 < 3 stays; A>0 untouched (clipped to -1.2).
    assert loss == pytest.approx([3.0, 2.0, -1.2])
    assert clipped == [1.0, 0.0, 1.0]


def test_policy_loss_gradient_is_zero_where_clipped():
    logp = torch.tensor([[math.log(1.5), math.log(1.1)]], requires_grad=True)
    loss, _ = clipped_policy_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), clip_ratio_low=0.2, clip_ratio_high=0.2)
    loss.sum().backward()
    assert logp.grad[0, 0].item() == 0.0
    assert logp.grad[0, 1].item() == pytest.approx(-1.1)


LOGP, REF = math.log(0.5), math.log(0.25)


@pytest.mark.parametrize("kind,expected", [
    ("k1", math.log(2)),
    ("kl", math.log(2)),
    ("k2", 0.5 * math.log(2) ** 2),
    ("mse", 0.5 * math.log(2) ** 2),
    ("k3", 0.5 + math.log(2) - 1),            # r = pi_ref / pi = 0.5: r - log r - 1
    ("low_var_kl", 0.5 + math.log(2) - 1),
])
def test_each_kl_estimator_matches_its_hand_computed_value(kind, expected):
    out = kl_penalty(torch.tensor([[LOGP]], dtype=torch.float64), torch.tensor([[REF]], dtype=torch.float64), kind)
    assert out.item() == pytest.approx(expected)


def test_k3_is_zero_when_the_policies_agree_and_clamped_for_outliers():
    logp = torch.tensor([[-1.0, 0.0, -30.0]])
    ref = torch.tensor([[-1.0, -30.0, 0.0]])
    out = kl_penalty(logp, ref, "k3")[0].tolist()
    assert out[0] == 0.0
    # log r = -30 clamps to -20: e^-20 + 20 - 1 = 19 -> clamped to 10; log r = 30 clamps to 20 -> huge -> 10.
    assert out[1] == pytest.approx(10.0)
    assert out[2] == pytest.approx(10.0)


def test_unknown_kl_type_is_a_value_error_naming_the_field():
    with pytest.raises(ValueError, match="kl_type"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


def test_entropy_of_uniform_logits_is_log_vocab_and_of_one_hot_is_zero():
    uniform = torch.zeros(1, 1, 8)
    peaked = torch.tensor([[[100.0, 0.0, 0.0]]])
    assert entropy_from_logits(uniform).item() == pytest.approx(math.log(8))
    assert entropy_from_logits(peaked).item() == pytest.approx(0.0, abs=1e-6)


LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)


@pytest.mark.parametrize("mode,expected,units", [
    ("token-mean", 10 / 4, 4),
    ("seq-mean-token-sum", (6 + 4) / 2, 2),
    ("seq-mean-token-mean", (2 + 4) / 2, 2),
])
def test_each_aggregation_mode_matches_its_hand_computed_value(mode, expected, units):
    assert aggregate(LOSS, MASK, mode).item() == pytest.approx(expected)
    assert num_units(MASK, mode) == units


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_micro_batch_losses_with_the_mini_batch_denominator_sum_to_the_mini_batch_loss(mode):
    whole = aggregate(LOSS, MASK, mode)
    denom = num_units(MASK, mode)
    parts = aggregate(LOSS[:1], MASK[:1], mode, denom=denom) + aggregate(LOSS[1:], MASK[1:], mode, denom=denom)
    assert parts.item() == pytest.approx(whole.item())


def test_unknown_aggregation_mode_is_a_value_error_naming_the_field():
    with pytest.raises(ValueError, match="loss_agg_mode"):
        aggregate(LOSS, MASK, "sum")


def test_value_loss_takes_the_larger_of_clipped_and_unclipped_errors():
    values = torch.tensor([[1.0, 0.5, 0.0]])
    old = torch.tensor([[0.0, 0.0, 0.0]])
    returns = torch.tensor([[1.0, 0.0, 0.0]])
    loss, clipped = clipped_value_loss(values, old, returns, clip_value=0.2)
    # v=1: unclipped 0, v_clip=0.2 -> (0.2-1)^2 = 0.64; v=0.5: unclipped 0.25, v_clip 0.2 -> 0.04.
    assert loss[0].tolist() == pytest.approx([0.32, 0.125, 0.0])
    assert clipped[0].tolist() == [1.0, 0.0, 0.0]
    plain, none = clipped_value_loss(values, old, returns, clip_value=0.0)
    assert plain[0].tolist() == pytest.approx([0.0, 0.125, 0.0])
    assert none.sum().item() == 0.0
