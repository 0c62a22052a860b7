"""Rollout correction (coordinator/training/rollout_correction.py): weights and metrics on a hand-computed batch,
and its wiring into the step (advantages scaled in decoupled mode, rollout log-probs as the old policy in bypass
mode)."""

import math

import pytest
import torch

from coordinator.recipe.config import RunConfig, rollout_correction
from coordinator.training.phases import needs_old_logprobs, policy_samples
from coordinator.training.rollout_correction import correction_metrics, correction_weights
from services.common.config import load_config

# Two sequences, the second one token shorter. log(pi_old / pi_rollout) = [[0.5, -1, 0], [1, 0, (pad)]].
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]])
ROLL = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -1.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
e = math.exp


def weights(level, method, threshold=2.0, low=None):
    w, _ = correction_weights(OLD, ROLL, MASK, level=level, method=method, threshold=threshold, threshold_low=low)
    return w


@pytest.mark.parametrize("level,method,want", [
    ("token", "truncate", [[e(0.5), e(-1), 1.0], [2.0, 1.0, 0.0]]),
    ("sequence", "truncate", [[e(-0.5)] * 3, [2.0, 2.0, 0.0]]),                 # e(1) = 2.72 capped at 2
    ("geometric", "truncate", [[e(-0.5 / 3)] * 3, [e(0.5), e(0.5), 0.0]]),
    ("token", "mask", [[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]),                     # e(-1) < 1/2, e(1) > 2
    ("sequence", "mask", [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]),
])
def test_correction_weights_equal_the_hand_computed_ones(level, method, want):
    torch.testing.assert_close(weights(level, method), torch.tensor(want))


def test_a_lower_mask_bound_rejects_sequences_below_it():
    torch.testing.assert_close(weights("sequence", "mask", threshold=3.0, low=0.7),
                               torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))


def test_correction_metrics_equal_the_hand_computed_ones():
    w, raw = correction_weights(OLD, ROLL, MASK, level="token", method="truncate", threshold=2.0)
    m = correction_metrics(OLD, ROLL, MASK, w, raw, level="token", method="truncate", threshold=2.0)
    tokens = [e(0.5), e(-1), 1.0, 2.0, 1.0]
    assert m["rollout_corr/weight_mean"] == pytest.approx(sum(tokens) / 5)
    assert m["rollout_corr/weight_max"] == pytest.approx(2.0)
    assert m["rollout_corr/raw_weight_max"] == pytest.approx(e(1))
    assert m["rollout_corr/ess"] == pytest.approx(sum(tokens) ** 2 / (5 * sum(t * t for t in tokens)))
    assert m["rollout_corr/fraction_truncated"] == pytest.approx(1 / 5)
    # KL(rollout || trainer): k1 = mean(log pi_rollout - log pi_old); k3 = mean(r - 1 - log r), r = pi_old / pi_rollout
    assert m["rollout_corr/kl_k1"] == pytest.approx(-(0.5 - 1 + 0 + 1 + 0) / 5)
    k3 = [e(x) - 1 - x for x in (0.5, -1.0, 0.0, 1.0, 0.0)]
    assert m["rollout_corr/kl_k3"] == pytest.approx(sum(k3) / 5)
    # trainer minus rollout log-perplexity, per sequence, then the mean: ((0.5 / 3) + (-1 / 2)) / 2
    assert m["rollout_corr/log_ppl_diff"] == pytest.approx((0.5 / 3 - 0.5) / 2)


def test_masked_sequences_count_once_each_in_the_masked_fraction():
    w, raw = correction_weights(OLD, ROLL, MASK, level="sequence", method="mask", threshold=2.0)
    m = correction_metrics(OLD, ROLL, MASK, w, raw, level="sequence", method="mask", threshold=2.0)
    assert m["rollout_corr/fraction_masked"] == pytest.approx(0.5)
    assert m["rollout_corr/weight_mean"] == pytest.approx(0.5) and m["rollout_corr/ess"] == pytest.approx(0.5)


def test_equal_log_probs_give_unit_weights_and_zero_kl():
    w, raw = correction_weights(OLD, OLD, MASK, level="sequence", method="truncate", threshold=2.0)
    m = correction_metrics(OLD, OLD, MASK, w, raw, level="sequence", method="truncate", threshold=2.0)
    torch.testing.assert_close(w, MASK)
    assert m["rollout_corr/kl_k1"] == 0 and m["rollout_corr/kl_k3"] == 0 and m["rollout_corr/ess"] == 1


class _Ctx:
    def __init__(self, step: int, **algorithm):
        self.step = step
        self.cfg = load_config(RunConfig, data={"algorithm": algorithm})


def test_decoupled_mode_computes_old_logprobs_every_step_and_bypass_only_for_parity():
    decoupled = {"rollout_correction": {"mode": "decoupled"}}
    bypass = {"rollout_correction": {"mode": "bypass"}, "logprob_parity_every": 10}
    assert needs_old_logprobs(_Ctx(1, **decoupled), 32)
    assert not needs_old_logprobs(_Ctx(1, **bypass), 32) and needs_old_logprobs(_Ctx(0, **bypass), 32)


def test_bypass_mode_trains_against_the_rollout_logprobs():
    from coordinator.training import remote
    s = remote.Sample(problem=None, group=0, prompt_ids=[1], response_ids=[2, 3], rollout_logprobs=[-0.5, -0.25],
                      text="", finish_reason="stop", weight_version=0, old_logprobs=[-0.4, -0.2])
    assert policy_samples(_Ctx(1, rollout_correction={"mode": "bypass"}), [s])[0].old_logprobs == [-0.5, -0.25]
    assert policy_samples(_Ctx(1, rollout_correction={"mode": "decoupled"}), [s])[0].old_logprobs == [-0.4, -0.2]
    assert s.old_logprobs == [-0.4, -0.2]        # the sample itself is left as measured


def test_tis_cap_is_token_truncation_in_decoupled_mode_and_excludes_rollout_correction():
    rc = rollout_correction(_Ctx(1, tis_cap=3.0).cfg.algorithm)
    assert (rc.mode, rc.level, rc.method, rc.threshold) == ("decoupled", "token", "truncate", 3.0)
    with pytest.raises(ValueError, match="tis_cap"):
        _Ctx(1, tis_cap=3.0, rollout_correction={"mode": "bypass"})
    with pytest.raises(ValueError, match="threshold_low"):
        _Ctx(1, rollout_correction={"mode": "decoupled", "threshold_low": 0.5})
