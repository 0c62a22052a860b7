"""ConfigureRun on the engine: a run's optimizer settings replace the trainer's, reset or keep the schedule's
step, and come back as the values in effect."""

from __future__ import annotations

import pytest

from services.common.config import load_config
from services.common.errors import FailedPrecondition
from services.trainer.config import OptimSection, RunOptim, TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.testing import make_tiny_model, random_samples
from services.trainer.types import ActorLoss


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def engine(model_path: str, **sections) -> TrainerEngine:
    data = {"model": {"path": model_path}, "actor": {"lr": 2e-5}, **sections}
    return TrainerEngine(load_config(TrainerSettings, data=data))


def train_step(e: TrainerEngine) -> dict[str, float]:
    return e.train_actor(random_samples(4), ActorLoss())


def test_a_runs_learning_rate_replaces_the_trainers_and_shows_in_the_step_metrics(model_path):
    e = engine(model_path)
    asked = OptimSection(lr=0.5, weight_decay=0.1, betas=(0.8, 0.95), eps=1e-6, grad_clip=0.5)
    applied = e.configure_run(RunOptim(asked))
    assert applied.actor == asked
    assert applied.actor_lr == 0.5
    assert train_step(e)["lr"] == 0.5
    assert e.rank.actor.optimizer.param_groups[0]["weight_decay"] == 0.1


def test_a_new_run_restarts_the_warmup_and_a_resumed_one_keeps_its_step(model_path):
    e = engine(model_path)
    warm = OptimSection(lr=0.4, warmup_steps=4)
    e.configure_run(RunOptim(warm))
    lrs = [train_step(e)["lr"] for _ in range(2)]
    assert lrs == pytest.approx([0.1, 0.2])
    assert e.configure_run(RunOptim(warm, reset_schedule=False)).actor_lr == pytest.approx(0.3)
    assert e.configure_run(RunOptim(warm, reset_schedule=True)).actor_lr == pytest.approx(0.1)


def test_an_invalid_run_setting_is_refused_by_its_key_and_nothing_changes(model_path):
    e = engine(model_path)
    with pytest.raises(ValueError) as err:
        # As ConfigureRun's wire gives it: unchecked until the trainer's section takes it.
        e.configure_run(RunOptim(OptimSection.model_construct(lr=0.1, lr_schedule="cosine", warmup_steps=5,
                                                              total_steps=3)))
    assert str(err.value) == ("actor.total_steps: the cosine schedule needs total_steps > "
                              "warmup_steps (3 <= 5)")
    assert e.rank.actor.optimizer.param_groups[0]["lr"] == 2e-5


def test_critic_settings_for_a_trainer_without_a_critic_are_refused(model_path):
    e = engine(model_path)
    with pytest.raises(FailedPrecondition) as err:
        e.configure_run(RunOptim(OptimSection(lr=0.1), OptimSection(lr=0.1)))
    assert str(err.value) == "critic: this trainer has no critic (set when the trainer starts)"
