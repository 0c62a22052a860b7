"""A run that starts on a trainer that trained before starts from the model path (or a checkpoint), not from the
weights the last run left: ConfigureRun with a start reloads the weights, clears the optimizer state and restarts
the schedule; a fresh trainer is not reloaded; a resume (no start) keeps everything."""

from __future__ import annotations

import pytest
import torch

from services.common.config import load_config
from services.trainer import convert
from services.trainer.config import OptimSection, RunOptim, TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.testing import make_tiny_model, random_samples
from services.trainer.types import ActorLoss, CriticLoss, CriticSample, RunStart, RunStep

RUN = OptimSection(lr=0.05, warmup_steps=2)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def engine(model_path: str, **sections) -> TrainerEngine:
    return TrainerEngine(load_config(TrainerSettings, data={"model": {"path": model_path}, "actor": {"lr": 0.05},
                                                            **sections}))


def weights(e: TrainerEngine, name: str = "actor") -> dict[str, torch.Tensor]:
    model = e.rank.actor if name == "actor" else e.rank.critic
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def train(e: TrainerEngine, run_id: str = "first", steps: int = 2) -> None:
    for step in range(1, steps + 1):
        e.train_actor_step(random_samples(4, seed=step), ActorLoss(), RunStep(run_id, step, 4 * step))


def test_a_started_run_gets_the_model_paths_weights_an_empty_optimizer_and_schedule_step_0(model_path):
    e = engine(model_path)
    start_up = weights(e)
    e.configure_run(RunOptim(RUN))
    train(e)
    assert e.rank.actor.optimizer.state and e.rank.actor.step == 2
    assert not torch.equal(weights(e)["model.embed_tokens.weight"], start_up["model.embed_tokens.weight"])
    version = e.rank.weight_version

    applied = e.configure_run(RunOptim(RUN, start=RunStart()))

    assert_same(weights(e), start_up)
    assert not e.rank.actor.optimizer.state
    assert (e.rank.actor.step, e.rank.actor.scheduler.last_epoch) == (0, 0)
    assert applied.actor_lr == pytest.approx(0.025)                 # warm-up step 1 of 2, as a fresh trainer's
    assert applied.started_from == f"model.path {model_path} (weights reloaded, optimizer state cleared)"
    # A version no replica holds, so the replicas are pushed the reset weights before the run's first generate.
    assert applied.weight_version == e.rank.weight_version == version + 1
    assert e.steps.last is None                                      # no run step made these weights


def test_the_first_step_after_a_start_matches_a_fresh_trainers(model_path):
    used, fresh = engine(model_path), engine(model_path)
    used.configure_run(RunOptim(RUN))
    train(used)
    used.configure_run(RunOptim(RUN, start=RunStart()))
    fresh.configure_run(RunOptim(RUN, start=RunStart()))
    a = used.train_actor(random_samples(4, seed=7), ActorLoss())
    b = fresh.train_actor(random_samples(4, seed=7), ActorLoss())
    for key in ("pg_loss", "grad_norm", "lr"):
        assert a[key] == pytest.approx(b[key], abs=1e-6), key
    assert_same(weights(used), weights(fresh))


def test_a_fresh_trainer_is_not_reloaded_and_keeps_its_version(model_path):
    e = engine(model_path)
    applied = e.configure_run(RunOptim(RUN, start=RunStart()))
    assert applied.started_from == (f"model.path {model_path} (the trainer's start-up weights, untouched: "
                                    f"not reloaded)")
    assert applied.weight_version == 0


def test_a_resumed_run_keeps_its_weights_optimizer_state_and_step(model_path):
    e = engine(model_path)
    e.configure_run(RunOptim(RUN))
    train(e, "resumed")
    trained = weights(e)
    applied = e.configure_run(RunOptim(RUN, reset_schedule=False))
    assert_same(weights(e), trained)
    assert e.rank.actor.optimizer.state and e.rank.actor.step == 2
    assert applied.started_from == "" and e.steps.last == RunStep("resumed", 2, 8)


def test_a_run_starts_from_a_checkpoints_weights_with_a_fresh_optimizer(model_path, tmp_path):
    e = engine(model_path)
    e.configure_run(RunOptim(RUN))
    train(e)
    e.save_checkpoint(str(tmp_path / "ckpt"))
    saved = weights(e)
    train(e, "second", steps=1)
    version = e.rank.weight_version

    applied = e.configure_run(RunOptim(RUN, start=RunStart(str(tmp_path / "ckpt"))))

    assert_same(weights(e), saved)
    assert not e.rank.actor.optimizer.state and e.rank.actor.step == 0
    assert applied.weight_version == version + 1
    assert applied.started_from.startswith(f"checkpoint {tmp_path / 'ckpt'} (weights loaded")
    # Taken from a checkpoint, the weights are not the model path's: the next start reloads them.
    assert e.configure_run(RunOptim(RUN, start=RunStart())).started_from.endswith("(weights reloaded, optimizer "
                                                                                   "state cleared)")


def test_a_missing_checkpoint_is_refused_by_name_and_nothing_changes(model_path, tmp_path):
    e = engine(model_path)
    e.configure_run(RunOptim(RUN))
    train(e)
    trained = weights(e)
    with pytest.raises(Exception) as err:
        e.configure_run(RunOptim(RUN, start=RunStart(str(tmp_path / "nowhere"))))
    assert str(tmp_path / "nowhere") in str(err.value)
    assert_same(weights(e), trained)
    assert e.rank.actor.step == 2


def test_a_critics_backbone_and_value_head_start_over_too(model_path):
    e = engine(model_path, critic={"lr": 0.01})
    start_up = weights(e, "critic")
    run = RunOptim(RUN, OptimSection(lr=0.01))
    e.configure_run(run)
    sample = random_samples(4)
    e.train_critic([CriticSample(s.prompt_ids, s.response_ids, returns=[1.0] * len(s.response_ids))
                    for s in sample], CriticLoss())
    train(e, steps=1)
    assert not torch.equal(weights(e, "critic")["value_head.weight"], start_up["value_head.weight"])
    e.configure_run(RunOptim(RUN, OptimSection(lr=0.01), start=RunStart()))
    assert_same(weights(e, "critic"), start_up)
    assert not e.rank.critic.optimizer.state and e.rank.critic.step == 0


def test_the_start_crosses_the_wire_both_ways():
    asked = RunOptim(RUN, start=RunStart("runs/a/checkpoints/step_2"))
    assert convert.run_optim_from_pb(convert.run_optim_to_pb(asked)).start == RunStart("runs/a/checkpoints/step_2")
    assert convert.run_optim_from_pb(convert.run_optim_to_pb(RunOptim(RUN))).start is None
    answer = RunOptim(RUN, started_from="model.path m (weights reloaded)", weight_version=7)
    back = convert.run_optim_from_pb(convert.run_optim_to_pb(answer, response=True))
    assert (back.started_from, back.weight_version) == ("model.path m (weights reloaded)", 7)


def test_under_lora_the_adapters_start_over_and_the_frozen_base_is_not_read_again(model_path):
    e = engine(model_path, actor={"lr": 0.05, "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}})
    assert e.rank.initial["actor"].folder is None
    start_up = weights(e)
    e.configure_run(RunOptim(RUN))
    train(e)
    assert any(not torch.equal(v, start_up[k]) for k, v in weights(e).items() if ".lora_B." in k)
    e.configure_run(RunOptim(RUN, start=RunStart()))
    assert_same(weights(e), start_up)
