"""`run.init_from` resolved before a run starts (a run id -> its newest checkpoint, or a checkpoint folder; anything
else refused by name), and a run that started from one starts from it again when a restarted trainer lost it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from coordinator.recipe.config import RunConfig
from coordinator.runapi import recovery
from coordinator.runapi.checkpoints import resolve_init_from
from coordinator.runapi.store import MemoryStore, RunRecord
from meshrl.v1 import common_pb2, trainer_pb2


def finished_checkpoint(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "manifest.json").write_text("{}")
    return path


def resolve(value: str, store: MemoryStore | None = None, run_dir: str = "runs") -> tuple[str, str]:
    return asyncio.run(resolve_init_from(value, store or MemoryStore(), run_dir))


def test_unset_init_from_starts_from_the_model_path():
    assert resolve("") == ("", "")


def test_a_run_id_of_the_store_resolves_to_that_runs_newest_checkpoint(tmp_path):
    store = MemoryStore()
    path = finished_checkpoint(tmp_path / "r1" / "checkpoints" / "step_4")
    asyncio.run(store.put(RunRecord("r1", "", checkpoint_path=str(path), checkpoint_step=4)))
    assert resolve("r1", store) == (str(path), f"run r1's checkpoint of step 4 at {path}")


def test_a_run_of_the_store_without_a_checkpoint_is_refused_by_name():
    store = MemoryStore()
    asyncio.run(store.put(RunRecord("r1", "")))
    with pytest.raises(ValueError) as err:
        resolve("r1", store)
    assert str(err.value).startswith("run.init_from: run 'r1' has no checkpoint (it ran with "
                                     "run.checkpoint_every: 0")


def test_a_run_of_an_earlier_coordinator_resolves_to_its_newest_finished_checkpoint_folder(tmp_path):
    done = finished_checkpoint(tmp_path / "old" / "checkpoints" / "step_2")
    (tmp_path / "old" / "checkpoints" / "step_4").mkdir()          # a save that never finished: no manifest
    assert resolve("old", run_dir=str(tmp_path)) == (str(done), f"run old's checkpoint of step 2 at {done}")


def test_a_checkpoint_folder_is_taken_as_it_is(tmp_path):
    folder = finished_checkpoint(tmp_path / "ckpt")
    assert resolve(str(folder)) == (str(folder), f"checkpoint {folder}")


def test_a_value_that_names_no_run_and_no_checkpoint_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError) as err:
        resolve("r0", run_dir=str(tmp_path))
    assert str(err.value) == (f"run.init_from: 'r0' is neither a run (none by that id, no finished checkpoint under "
                              f"{tmp_path / 'r0' / 'checkpoints'}) nor a checkpoint folder (no manifest.json in it)")


class FakeTrainer:
    """GetInfo with a weight version and no applied run step; ConfigureRun answers a start as the trainer does."""

    def __init__(self, weight_version: int):
        self.weight_version = weight_version
        self.configured = None

    async def GetInfo(self, request):
        return common_pb2.ServiceInfo(role="trainer", weight_version=self.weight_version)

    async def ConfigureRun(self, request):
        self.configured = request
        self.weight_version = 9
        return trainer_pb2.ConfigureRunResponse(actor=request.actor, actor_lr=request.actor.lr, weight_version=9,
                                                started_from=f"checkpoint {request.start.checkpoint} (...)")


def settle_at_step_0(trainer_version: int) -> tuple[FakeTrainer, RunRecord]:
    trainer = FakeTrainer(trainer_version)
    record = RunRecord("r2", "", step=0, weight_version=5, init_checkpoint="/ckpt/step_4")
    ctx = SimpleNamespace(trainer=trainer, cfg=RunConfig(), weight_version=5)
    asyncio.run(recovery.settle_trainer(MemoryStore(), record, ctx))
    return trainer, record


def test_a_restarted_trainer_gets_the_init_from_checkpoint_back_before_step_1():
    trainer, record = settle_at_step_0(trainer_version=0)          # fresh: model.path's weights
    assert trainer.configured.HasField("start") and trainer.configured.start.checkpoint == "/ckpt/step_4"
    assert record.weight_version == 9


def test_a_trainer_still_holding_the_start_weights_is_left_alone():
    trainer, record = settle_at_step_0(trainer_version=5)
    assert trainer.configured is None and record.weight_version == 5
