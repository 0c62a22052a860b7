"""`actor.lr` from a recipe to the torch optimizer along the real path: the recipe read as the run's config, the
coordinator's ConfigureRun request (coordinator/recipe/run_settings.py), the wire as bytes (services/trainer/convert.py),
the trainer's servicer and engine, and the rank's optimizer (services/trainer/commands.py, model/optim.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from coordinator.recipe.config import RunConfig
from meshrl.v1 import trainer_pb2
from services.common.config import load_config
from services.trainer import convert
from services.trainer.config import RunOptim, TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.servicer import TrainerServicer
from services.trainer.testing import make_tiny_model, random_samples
from services.trainer.types import ActorLoss

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "arith" / "grpo.yaml"


def test_the_lr_a_recipe_sets_reaches_the_optimizer_and_the_next_step(tmp_path):
    recipe = load_config(RunConfig, RECIPE)
    assert recipe.actor.lr == 2.0e-5                    # what the recipe says, not a default
    trainer = TrainerEngine(load_config(TrainerSettings, data={"model": {"path": make_tiny_model(tmp_path / "m")},
                                                               "actor": {"lr": 1e-3}}))
    request = trainer_pb2.ConfigureRunRequest.FromString(
        convert.run_optim_to_pb(RunOptim(recipe.actor, recipe.critic)).SerializeToString())
    answer = asyncio.run(TrainerServicer(trainer, sender=None).ConfigureRun(request, None))
    applied = convert.run_optim_from_pb(trainer_pb2.ConfigureRunResponse.FromString(answer.SerializeToString()))
    assert applied.actor.lr == applied.actor_lr == 2.0e-5
    assert [g["lr"] for g in trainer.rank.actor.optimizer.param_groups] == [2.0e-5]
    assert trainer.train_actor(random_samples(4), ActorLoss())["lr"] == 2.0e-5
