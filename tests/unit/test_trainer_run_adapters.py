"""A concurrent run's named adapter on the trainer (docs/many_runs.md): TrainActor, ComputeLogProbs and ConfigureRun
with `adapter` touch that adapter alone, the run's own ("") is untouched, and a start on a named adapter is refused."""

from __future__ import annotations

import pytest
import torch

from services.common.config import load_config
from services.common.errors import FailedPrecondition
from services.trainer.config import OptimSection, RunOptim, TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.model.lora import adapter_state
from services.trainer.testing import make_tiny_model
from services.trainer.types import ActorLoss, RunStart, RunStep, TrainSample

LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
SAMPLES = [TrainSample([1, 2], [5, 6, 7], [1.0, 1.0, 1.0], []), TrainSample([3], [8, 9], [-1.0, -1.0], [])]


def _engine(tmp_path) -> TrainerEngine:
    data = {"model": {"path": make_tiny_model(tmp_path / "m")},
            "actor": {"lr": 1e-3, "shuffle": False, "fused_logprobs": False, "lora": LORA}}
    return TrainerEngine(load_config(TrainerSettings, data=data))


def _weights(engine: TrainerEngine, name: str) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in adapter_state(engine.rank.actor.module, name).items()}


def test_train_actor_on_a_named_adapter_changes_it_alone_under_its_own_lr_and_version(tmp_path):
    engine = _engine(tmp_path)
    engine.create_adapter("run-b")
    before_default, before_b = _weights(engine, "default"), _weights(engine, "run-b")
    base = engine.compute_logprobs([[1, 2]], [[5, 6, 7]])
    answer = engine.configure_run(RunOptim(OptimSection(lr=5e-2), adapter="run-b"))
    assert answer.actor.lr == 5e-2 and answer.adapter == "run-b" and answer.weight_version == 0
    assert engine.rank.actor.cfg.lr == 1e-3                    # the run's own optimizer keeps its lr
    version = engine.rank.weight_version
    metrics, repeated = engine.train_actor_step(SAMPLES, ActorLoss(), RunStep("b", 1, 2, {}), "run-b")
    assert metrics["lr"] == pytest.approx(5e-2) and not repeated
    assert engine.adapter_progress("run-b") == (1, 1)
    assert engine.rank.weight_version == version and engine.rank.actor.step == 0
    assert engine.steps.last is None                           # the record is the default run's alone
    after_b = _weights(engine, "run-b")
    assert any(not torch.equal(after_b[k], before_b[k]) for k in after_b)
    assert all(torch.equal(v, before_default[k]) for k, v in _weights(engine, "default").items())
    # The run's forward is the base's (its adapter untrained); the named adapter's now differs from it.
    assert engine.compute_logprobs([[1, 2]], [[5, 6, 7]]) == base
    assert engine.compute_logprobs([[1, 2]], [[5, 6, 7]], adapter="run-b") != base
    # The reference (adapters off) is the base for a named adapter's run too.
    assert engine.compute_reference_logprobs([[1, 2]], [[5, 6, 7]]) == base


def test_a_named_adapter_run_is_refused_a_start_and_a_critic(tmp_path):
    engine = _engine(tmp_path)
    engine.create_adapter("run-c")
    with pytest.raises(FailedPrecondition, match="start: adapter 'run-c' starts as the base"):
        engine.configure_run(RunOptim(OptimSection(lr=1e-2), start=RunStart(""), adapter="run-c"))
    with pytest.raises(FailedPrecondition, match="critic: adapter 'run-c'"):
        engine.configure_run(RunOptim(OptimSection(lr=1e-2), OptimSection(lr=1e-2), adapter="run-c"))
