"""DPO, IPO and conservative DPO losses against hand-computed values."""

import math

import pytest
import torch

from services.trainer.updates.losses import dpo_loss


def _t(*xs):
    return torch.tensor(xs, dtype=torch.float64)


def test_sigmoid_dpo_loss_is_minus_log_sigmoid_of_the_scaled_margin():
    # h = (-1 - -2) - (-3 - -2.5) = 1 + 0.5 = 1.5 ; beta h = 0.15
    loss, m = dpo_loss(_t(-1.0), _t(-3.0), _t(-2.0), _t(-2.5), beta=0.1)
    assert loss.item() == pytest.approx(-math.log(1 / (1 + math.exp(-0.15))))
    assert m["rewards/chosen"].item() == pytest.approx(0.1)
    assert m["rewards/rejected"].item() == pytest.approx(-0.05)
    assert m["rewards/margins"].item() == pytest.approx(0.15)
    assert m["rewards/accuracy"].item() == 1.0


def test_dpo_loss_is_log_two_when_policy_equals_reference():
    loss, m = dpo_loss(_t(-1.0, -4.0), _t(-2.0, -1.0), _t(-1.0, -4.0), _t(-2.0, -1.0), beta=0.5)
    assert torch.allclose(loss, torch.full((2,), math.log(2), dtype=torch.float64))
    assert m["rewards/accuracy"].sum().item() == 0.0


def test_conservative_dpo_mixes_both_label_directions():
    eps, beta, h = 0.1, 0.2, 1.5
    loss, _ = dpo_loss(_t(-1.0), _t(-3.0), _t(-2.0), _t(-2.5), beta=beta, loss_type="cdpo", label_smoothing=eps)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    expected = -(1 - eps) * math.log(sig(beta * h)) - eps * math.log(sig(-beta * h))
    assert loss.item() == pytest.approx(expected)


def test_ipo_loss_is_squared_distance_of_the_margin_to_one_over_two_beta():
    loss, _ = dpo_loss(_t(-1.0), _t(-3.0), _t(-2.0), _t(-2.5), beta=0.25, loss_type="ipo")
    assert loss.item() == pytest.approx((1.5 - 2.0) ** 2)


def test_dpo_gradient_raises_chosen_and_lowers_rejected():
    chosen = torch.tensor([-2.0], requires_grad=True)
    rejected = torch.tensor([-2.0], requires_grad=True)
    loss, _ = dpo_loss(chosen, rejected, _t(-2.0).float(), _t(-2.0).float(), beta=0.1)
    loss.sum().backward()
    assert chosen.grad.item() < 0 < rejected.grad.item()


@pytest.mark.parametrize("kwargs,field", [({"beta": 0.0}, "beta"), ({"beta": 0.1, "loss_type": "kto"}, "loss_type"),
                                          ({"beta": 0.1, "label_smoothing": 0.7}, "label_smoothing")])
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        dpo_loss(_t(-1.0), _t(-1.0), _t(-1.0), _t(-1.0), **kwargs)
