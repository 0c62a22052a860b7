"""fp16 compute with dynamic loss scaling: overflowing steps are skipped and back the scale off, finite runs
grow it, the unscaled update matches fp32, and the scaler state survives a checkpoint."""

from __future__ import annotations

import pytest
import torch

from services.common.config import load_config
from services.common.tensors.weights import named_weights
from services.trainer.config import TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.model.optim import DynamicLossScaler
from services.trainer.testing import make_tiny_model, random_samples
from services.trainer.types import ActorLoss

LOSS = ActorLoss(kl_coef=0.0, entropy_coef=0.01)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny16") / "model")


def engine(model_path: str, **actor) -> TrainerEngine:
    return TrainerEngine(load_config(TrainerSettings, data={"model": {"path": model_path},
                                                            "actor": {"lr": 1e-3, **actor}}))


def params(e: TrainerEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in named_weights(e.rank.actor.module).items()}


def batch(e: TrainerEngine, seed: int = 0):
    samples = random_samples(4, seed=seed)
    for s, lp in zip(samples, e.compute_logprobs([s.prompt_ids for s in samples], [s.response_ids for s in samples])):
        s.old_logprobs = lp
    return samples


def test_the_scaler_backs_off_on_overflow_and_grows_after_the_interval_by_torchs_own_rule():
    ours = DynamicLossScaler(2.0 ** 10, growth_interval=3)
    # The kernel torch.amp.GradScaler.update runs, fed the same overflow decisions.
    scale, tracker = torch.full((), 2.0 ** 10), torch.zeros((), dtype=torch.int32)
    for found_inf in [False, False, True, False, False, False, False, True, True, False]:
        ours.update(found_inf)
        torch._amp_update_scale_(scale, tracker, torch.full((), float(found_inf)), 2.0, 0.5, 3)
        assert ours.scale == scale.item() and ours._growth_tracker == tracker.item()
    assert ours.scale == 2.0 ** 8          # 2**10 -> 2**9 -> 2**10 -> 2**9 -> 2**8
    assert set(ours.state_dict()) == set(torch.amp.GradScaler("cpu").state_dict())


def test_an_fp16_step_that_overflows_is_skipped_without_touching_weights_and_halves_the_scale(model_path):
    e = engine(model_path, dtype="float16", loss_scale_growth_interval=2)
    assert e.rank.compute_dtype == "float16" and e.rank.param_dtype == "float32" and e.rank.actor.scaler is not None
    samples = batch(e)
    before = params(e)
    # Injected overflow: a scale far beyond fp16's range makes the fp16 backward produce inf gradients.
    e.rank.actor.scaler.scale = 2.0 ** 40
    m = e.train_actor(samples, LOSS)
    assert m["num_skipped_steps"] == 1 and m["num_optimizer_steps"] == 0
    assert m["loss_scale"] == 2.0 ** 39
    assert all(torch.equal(before[k], v) for k, v in params(e).items())
    assert e.rank.actor.step == 0 and all(p.grad is None for p in e.rank.actor.module.parameters())

    # A scale that fits: steps are taken, and after growth_interval=2 finite steps in a row the scale doubles.
    e.rank.actor.scaler.scale = 2.0 ** 8
    m1 = e.train_actor(samples, LOSS)
    assert m1["num_skipped_steps"] == 0 and m1["loss_scale"] == 2.0 ** 8
    m2 = e.train_actor(batch(e, seed=1), LOSS)
    assert m2["num_skipped_steps"] == 0 and m2["loss_scale"] == 2.0 ** 9
    assert e.rank.actor.step == 2
    assert any(not torch.equal(before[k], v) for k, v in params(e).items())


def test_an_fp16_step_unscales_to_the_fp32_update(model_path):
    # Same batch and weights: the fp16 run's reported grad norm and its update equal fp32's up to fp16 rounding,
    # so the loss scale is taken out exactly once.
    half, full = engine(model_path, dtype="float16"), engine(model_path)
    samples = batch(full)
    start = params(full)
    mh, mf = half.train_actor(samples, LOSS), full.train_actor(samples, LOSS)
    assert mh["loss_scale"] == 2.0 ** 16 and mf["loss_scale"] == 1.0 and mh["num_skipped_steps"] == 0
    assert mh["grad_norm"] == pytest.approx(mf["grad_norm"], rel=2e-2)
    assert mh["pg_loss"] == pytest.approx(mf["pg_loss"], abs=2e-2)
    ph, pf = params(half), params(full)
    num = sum(float(((ph[k] - start[k]) - (pf[k] - start[k])).norm() ** 2) for k in pf) ** 0.5
    den = sum(float((pf[k] - start[k]).norm() ** 2) for k in pf) ** 0.5
    assert den > 0 and num / den < 0.05


def test_the_loss_scale_and_its_growth_tracker_survive_a_checkpoint(model_path, tmp_path):
    a = engine(model_path, dtype="float16", loss_scale_init=1024.0, loss_scale_growth_interval=3)
    a.train_actor(batch(a), LOSS)
    a.rank.actor.scaler.scale = 2.0 ** 40
    a.train_actor(batch(a, seed=1), LOSS)                    # skipped: 2**39
    a.rank.actor.scaler.scale = 512.0
    a.train_actor(batch(a, seed=2), LOSS)                    # one good step in a row
    a.save_checkpoint(str(tmp_path / "ck"))
    b = engine(model_path, dtype="float16")
    b.load_checkpoint(str(tmp_path / "ck"))
    assert b.rank.actor.scaler.state_dict() == a.rank.actor.scaler.state_dict()
    assert b.rank.actor.scaler.state_dict()["_growth_tracker"] == 1 and b.rank.actor.scaler.scale == 512.0
    samples = batch(a, seed=3)
    assert b.train_actor(samples, LOSS)["pg_loss"] == pytest.approx(a.train_actor(samples, LOSS)["pg_loss"], abs=1e-6)


def test_without_fp16_there_is_no_loss_scaling(model_path):
    e = engine(model_path, dtype="bfloat16")
    assert e.rank.actor.scaler is None
    assert e.train_actor(batch(e), LOSS)["loss_scale"] == 1.0
