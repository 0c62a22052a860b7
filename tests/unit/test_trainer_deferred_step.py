"""The deferred last optimizer step of a TrainActor call (fused AdamW: no host sync before the step): the same
update as checking the norm first, and a non-finite norm still skips the step without touching anything."""

from __future__ import annotations

import pytest
import torch

from services.common.config import load_config
from services.common.tensors.weights import named_weights
from services.trainer.config import TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.testing import make_tiny_model, random_samples
from services.trainer.types import ActorLoss

LOSS = ActorLoss(kl_coef=0.0, entropy_coef=0.01)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_defer") / "model")


def engine(model_path: str, *, defer: bool) -> TrainerEngine:
    e = TrainerEngine(load_config(TrainerSettings, data={"model": {"path": model_path}, "actor": {"lr": 1e-3}}))
    e.rank.defer_last_step = defer
    # On CUDA the trainer picks the fused AdamW itself; on a CPU it is asked for (torch has a CPU fused kernel).
    a = e.rank.actor
    a.optimizer = torch.optim.AdamW([p for p in a.module.parameters() if p.requires_grad], lr=1e-3, fused=True)
    a.scheduler = torch.optim.lr_scheduler.LambdaLR(a.optimizer, lambda step: 1.0 / (1 + step))
    return e


def params(e: TrainerEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in named_weights(e.rank.actor.module).items()}


def test_deferred_last_step_gives_the_same_update_metrics_and_schedule(model_path):
    checked, deferred = engine(model_path, defer=False), engine(model_path, defer=True)
    for step in range(3):
        samples = random_samples(4, seed=step)
        a, b = checked.train_actor(samples, LOSS), deferred.train_actor(samples, LOSS)
        timing = ("seconds", "tokens_per_s")
        assert {k: v for k, v in a.items() if k not in timing} == {k: v for k, v in b.items() if k not in timing}
        assert b["num_optimizer_steps"] == 1 and b["num_skipped_steps"] == 0
    pa, pb = params(checked), params(deferred)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert deferred.rank.actor.step == checked.rank.actor.step == 3
    assert deferred.rank.actor.scheduler.last_epoch == 3
    assert deferred.rank.actor.optimizer.param_groups[0]["lr"] == checked.rank.actor.optimizer.param_groups[0]["lr"]


def test_deferred_step_with_a_non_finite_norm_is_skipped_and_leaves_weights_state_and_schedule(model_path):
    e = engine(model_path, defer=True)
    e.train_actor(random_samples(4, seed=0), LOSS)
    with torch.no_grad():
        e.rank.actor.module.model.norm.weight[0] = float("inf")         # every gradient becomes non-finite
    before = params(e)
    state = {k: v.clone() for k, v in e.rank.actor.optimizer.state_dict()["state"][0].items()}
    lr = e.rank.actor.optimizer.param_groups[0]["lr"]
    m = e.train_actor(random_samples(4, seed=1), LOSS)
    assert m["num_optimizer_steps"] == 0 and m["num_skipped_steps"] == 1
    after = params(e)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(state[k], v) for k, v in e.rank.actor.optimizer.state_dict()["state"][0].items())
    assert e.rank.actor.step == 1 and e.rank.actor.scheduler.last_epoch == 1
    assert e.rank.actor.optimizer.param_groups[0]["lr"] == lr
    assert not hasattr(e.rank.actor.optimizer, "found_inf")
