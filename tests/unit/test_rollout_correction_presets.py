"""Rollout-correction presets (icepop, seq_mask_tis, geo_rs): what each expands to, and the weights of the
`mask_is` method and the token veto they use, on batches computed by hand."""

import math

import pytest
import torch

from coordinator.recipe.config import PRESETS, RolloutCorrectionConfig
from coordinator.training.rollout_correction import correction_metrics, correction_weights

e = math.exp


def test_each_preset_expands_to_decoupled_mode_and_its_published_settings():
    ice = RolloutCorrectionConfig(preset="icepop")
    assert (ice.mode, ice.level, ice.method, ice.threshold, ice.threshold_low, ice.veto_threshold) == \
        ("decoupled", "token", "mask_is", 5.0, 0.5, None)
    smt = RolloutCorrectionConfig(preset="seq_mask_tis")
    assert (smt.mode, smt.level, smt.method, smt.threshold, smt.threshold_low) == \
        ("decoupled", "geometric", "mask_is", 1.001, 0.999)
    geo = RolloutCorrectionConfig(preset="geo_rs")
    assert (geo.mode, geo.level, geo.method, geo.threshold, geo.threshold_low, geo.veto_threshold) == \
        ("decoupled", "geometric", "mask", 1.001, None, 1e-4)
    assert set(PRESETS) == {"icepop", "seq_mask_tis", "geo_rs"}


def test_a_key_written_beside_a_preset_overrides_it():
    c = RolloutCorrectionConfig(preset="icepop", threshold=3.0)
    assert (c.threshold, c.threshold_low, c.method) == (3.0, 0.5, "mask_is")


def test_a_preset_with_a_mode_that_applies_no_weights_is_refused_by_name():
    with pytest.raises(ValueError, match="mode: preset 'geo_rs' weights the advantages"):
        RolloutCorrectionConfig(preset="geo_rs", mode="bypass")
    with pytest.raises(ValueError, match="preset"):
        RolloutCorrectionConfig(preset="tis")


def test_icepop_keeps_the_token_ratio_inside_the_band_and_zero_outside():
    # Token ratios 0.25, 0.5, 1.5, 5, 8 (log-probs differ by their logs): kept as weights inside [0.5, 5].
    ratios = torch.tensor([[0.25, 0.5, 1.5, 5.0, 8.0]])
    old, roll, mask = ratios.log(), torch.zeros(1, 5), torch.ones(1, 5)
    p = PRESETS["icepop"]
    w, raw = correction_weights(old, roll, mask, level=p["level"], method=p["method"], threshold=p["threshold"],
                                threshold_low=p["threshold_low"])
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.5, 1.5, 5.0, 0.0]]))
    m = correction_metrics(old, roll, mask, w, raw, level="token", method="mask_is", threshold=5.0)
    assert m["rollout_corr/fraction_masked"] == pytest.approx(2 / 5)
    assert m["rollout_corr/weight_max"] == pytest.approx(5.0)


def test_seq_mask_tis_rejects_by_the_geometric_mean_and_weights_kept_tokens_by_their_own_ratio():
    # Row 0: log-ratios +0.0005, -0.0005 (geometric mean 1: kept), each token weighted e(+-0.0005).
    # Row 1: log-ratio 0.003 and a padded token at 9 that counts for nothing (geometric mean e(0.003) > 1.001:
    # rejected). Row 2: log-ratios 0.5, -0.5 (mean 0: kept although each token is far from 1).
    lr = torch.tensor([[0.0005, -0.0005], [0.003, 9.0], [0.5, -0.5]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    w, _ = correction_weights(lr, torch.zeros_like(lr), mask, level="geometric", method="mask_is",
                              threshold=1.001, threshold_low=0.999)
    torch.testing.assert_close(w, torch.tensor([[e(0.0005), e(-0.0005)], [0.0, 0.0], [e(0.5), e(-0.5)]]))


def test_geo_rs_weights_kept_sequences_one_and_the_veto_drops_a_sequence_with_one_collapsed_token():
    # Row 0: log-ratios 0.0004, -0.0004: geometric mean 1, kept with weight 1. Row 1: log-ratios 0, 0, -10: its
    # mean -3.33 is rejected by the band, and vetoed too (e^-10 < 1e-4). Row 2: 200 tokens whose mean log-ratio is
    # 0 (the band keeps it) with one token at e^-10: only the veto drops it.
    T = 200
    lr = torch.zeros(3, T)
    lr[0, :2] = torch.tensor([0.0004, -0.0004])
    lr[1, :3] = torch.tensor([0.0, 0.0, -10.0])
    lr[2, 0], lr[2, 1:] = -10.0, 10.0 / (T - 1)                       # mean log-ratio exactly 0
    mask = torch.zeros(3, T)
    mask[0, :2], mask[1, :3], mask[2, :] = 1.0, 1.0, 1.0
    p = PRESETS["geo_rs"]
    kw = dict(level=p["level"], method=p["method"], threshold=p["threshold"])
    no_veto, _ = correction_weights(lr, torch.zeros_like(lr), mask, **kw)
    w, raw = correction_weights(lr, torch.zeros_like(lr), mask, **kw, veto_threshold=p["veto_threshold"])
    torch.testing.assert_close(no_veto[:, 0], torch.tensor([1.0, 0.0, 1.0]))
    torch.testing.assert_close(w[:, 0], torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(w[0, :2], torch.ones(2))
    m = correction_metrics(lr, torch.zeros_like(lr), mask, w, raw, level="geometric", method="mask", threshold=1.001,
                           veto_threshold=1e-4)
    assert m["rollout_corr/fraction_vetoed"] == pytest.approx(2 / 3)
    assert m["rollout_corr/fraction_masked"] == pytest.approx(2 / 3)


def test_mask_is_at_level_token_equals_the_ratio_times_the_mask_method():
    g = torch.Generator().manual_seed(0)
    old, roll = -torch.rand(4, 6, generator=g) * 2, -torch.rand(4, 6, generator=g) * 2
    mask = (torch.rand(4, 6, generator=g) > 0.2).float()
    kw = dict(level="token", threshold=1.5, threshold_low=0.6)
    masked, _ = correction_weights(old, roll, mask, method="mask", **kw)
    weighted, _ = correction_weights(old, roll, mask, method="mask_is", **kw)
    torch.testing.assert_close(weighted, masked * (old - roll).exp() * mask)
    assert 0 < int((masked == 0).logical_and(mask > 0).sum()) < int(mask.sum())
