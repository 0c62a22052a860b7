"""The trainer's training-API commands (ForwardBackward, OptimStep; docs/training_api.md): gradients accumulate over
calls and a step applies them; the losses are Tinker's sums; bad input is refused by its field before any rank runs."""

from __future__ import annotations

import math

import pytest
import torch

from services.common.config import load_config
from services.common.errors import FailedPrecondition
from services.trainer.config import TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.testing import make_tiny_model
from services.trainer.types import AdamParams, Datum, PrimitiveLoss


def _engine(tmp_path, **actor) -> TrainerEngine:
    data = {"model": {"path": make_tiny_model(tmp_path / "m")},
            "actor": {"lr": 1e-3, "shuffle": False, "fused_logprobs": False, **actor}}
    return TrainerEngine(load_config(TrainerSettings, data=data))


def _datum(tokens: list[int], prompt: int, adv: float = 0.0) -> Datum:
    n = len(tokens) - 1
    return Datum(tokens[:-1], tokens[1:], weights=[0.0] * (prompt - 1) + [1.0] * (n - prompt + 1),
                 logprobs=[0.0] * n, advantages=[0.0] * (prompt - 1) + [adv] * (n - prompt + 1))


BATCH = [_datum([1, 5, 6, 7, 8, 9], 3, 1.0), _datum([1, 4, 4, 10, 11], 2, -0.5),
         _datum([1, 12, 13, 14], 2, 2.0), _datum([1, 7, 3, 3, 3, 3, 20], 4, -1.0)]


def _grads(engine: TrainerEngine) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in engine.rank.actor.module.parameters() if p.grad is not None])


def test_cross_entropy_is_the_weighted_sum_of_target_logprobs_and_its_outputs_are_them(tmp_path):
    engine = _engine(tmp_path)
    metrics, logprobs = engine.forward_backward(BATCH[:2], PrimitiveLoss("cross_entropy"))
    expected = engine.compute_logprobs([d.model_input[:1] for d in BATCH[:2]], [d.target_tokens for d in BATCH[:2]])
    for got, want in zip(logprobs, expected):
        assert got == pytest.approx(want, abs=1e-5)
    weighted = sum(w * lp for d, lps in zip(BATCH[:2], expected) for w, lp in zip(d.weights, lps))
    assert metrics["loss:sum"] == pytest.approx(-weighted, rel=1e-5)
    assert metrics["num_tokens"] == sum(sum(1 for w in d.weights if w) for d in BATCH[:2])


def test_two_forward_backward_calls_then_one_step_equal_one_call_over_both(tmp_path):
    split, whole = _engine(tmp_path / "a"), _engine(tmp_path / "b")
    for loss in ("importance_sampling", "ppo"):
        split.forward_backward(BATCH[:2], PrimitiveLoss(loss))
        split.forward_backward(BATCH[2:], PrimitiveLoss(loss))
        whole.forward_backward(BATCH, PrimitiveLoss(loss))
        assert torch.allclose(_grads(split), _grads(whole), atol=1e-6)
        version = split.rank.weight_version
        before = [p.detach().clone() for p in split.rank.actor.module.parameters()]
        # eps 1e-6: Adam's step on a near-zero gradient is its sign, which float noise between the two sums flips.
        adam = AdamParams(learning_rate=1e-2, eps=1e-6)
        m1, m2 = split.optim_step(adam), whole.optim_step(adam)
        assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-5) and m1["lr"] == 1e-2
        assert split.rank.weight_version == version + 1
        assert any(not torch.equal(a, b) for a, b in zip(before, split.rank.actor.module.parameters()))
        for a, b in zip(split.rank.actor.module.parameters(), whole.rank.actor.module.parameters()):
            assert torch.allclose(a, b, atol=1e-5)


def test_on_policy_importance_sampling_moves_logprobs_the_way_of_the_advantage(tmp_path):
    engine = _engine(tmp_path)
    up, down = _datum([1, 5, 6, 7], 2, 1.0), _datum([1, 9, 10, 11], 2, -1.0)
    before = engine.compute_logprobs([[1], [1]], [up.target_tokens, down.target_tokens])
    for d, lps in zip((up, down), before):
        d.logprobs = lps                             # sampled from these weights: the ratio is 1
    metrics, _ = engine.forward_backward([up, down], PrimitiveLoss("importance_sampling"))
    assert metrics["loss:sum"] == pytest.approx(-(3 * 1.0 + 3 * -1.0), abs=1e-5)
    engine.optim_step(AdamParams(learning_rate=1e-2, grad_clip_norm=1.0))
    after = engine.compute_logprobs([[1], [1]], [up.target_tokens, down.target_tokens])
    assert sum(after[0][1:]) > sum(before[0][1:]) and sum(after[1][1:]) < sum(before[1][1:])


def test_optim_step_without_gradients_and_bad_input_are_refused_by_name(tmp_path):
    engine = _engine(tmp_path)
    with pytest.raises(FailedPrecondition, match="no gradients to apply"):
        engine.optim_step(AdamParams(learning_rate=1e-3))
    shifted = Datum([1, 5, 6], [5, 7, 8])
    with pytest.raises(ValueError, match=r"^data\[0\]\.target_tokens: must be model_input shifted by one"):
        engine.forward_backward([shifted], PrimitiveLoss())
    with pytest.raises(ValueError, match=r"^data\[0\]\.logprobs: one per position \(3\), got 0 \(ppo reads it\)"):
        engine.forward_backward([Datum([1, 5, 6], [5, 6, 7])], PrimitiveLoss("ppo"))
    with pytest.raises(ValueError, match=r"^loss_fn\.name: unknown policy loss 'reinforce'"):
        engine.forward_backward(BATCH, PrimitiveLoss("reinforce"))
    with pytest.raises(ValueError, match=r"^data\[0\]\.model_input: token id 99 outside the vocabulary"):
        engine.forward_backward([Datum([1, 99], [99, 3])], PrimitiveLoss())
    engine.forward_backward(BATCH, PrimitiveLoss())
    with pytest.raises(ValueError, match=r"adam_params\.learning_rate"):
        engine.optim_step(AdamParams(learning_rate=0.0))
    assert math.isfinite(engine.optim_step(AdamParams(learning_rate=1e-3))["grad_norm"])
