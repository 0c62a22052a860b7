"""No step loses its record: a coordinator killed after the trainer applied step k's update but before the commit
leaves step k recorded once, with the metrics the trainer kept of it (the update's own and those the coordinator
sent with it), in the store, metrics.jsonl and TensorBoard."""

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from coordinator.runapi import recovery
from coordinator.runapi.store import MemoryStore, RunRecord
from coordinator.training.loop import RL
from meshrl.v1 import common_pb2
from services.common.config import load_config
from services.trainer.config import TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.testing import make_tiny_model, random_samples
from services.trainer.types import ActorLoss, RunStep

from tests.reliability.procs import kill_at_each_point, run_config

NUM_STEPS = 5
KILL_STEP = 3
BATCH = 4                   # data.rollout_batch_size of run_config


def test_the_trainer_reports_the_last_steps_metrics_with_the_weight_version_it_made(tmp_path):
    path = make_tiny_model(tmp_path / "model")
    e = TrainerEngine(load_config(TrainerSettings, data={"model": {"path": path}, "actor": {"lr": 1e-2}}))
    assert e.info()["run_step_metrics"] == ""
    metrics, _ = e.train_actor_step(random_samples(4, seed=0), ActorLoss(),
                                    RunStep("run-a", 1, 4, {"reward_mean": 0.25, "time/generate": 1.5}))
    kept = json.loads(e.info()["run_step_metrics"])
    assert kept == {"run_id": "run-a", "step": 1, "weight_version": e.rank.weight_version,
                    "coordinator": {"reward_mean": 0.25, "time/generate": 1.5}, "update": metrics}
    # A repeat of the step with other measurements is the same step: answered from the record, not trained.
    _, repeated = e.train_actor_step(random_samples(4, seed=1), ActorLoss(), RunStep("run-a", 1, 4, {"x": 1.0}))
    assert repeated and json.loads(e.info()["run_step_metrics"]) == kept
    e.load_checkpoint(e.save_checkpoint(str(tmp_path / "ck"))["path"], RunStep("run-a", 1, 4))
    assert e.info()["run_step_metrics"] == ""      # a checkpoint holds weights, not the step's metrics


class _Trainer:
    """A trainer stub whose GetInfo reports it applied step 4 of run-f as weight version `version`, keeping
    the metrics of weight version `kept_version`."""

    def __init__(self, version: int, kept_version: int):
        kept = {"run_id": "run-f", "step": 4, "weight_version": kept_version,
                "coordinator": {"reward_mean": 0.5, "time/generate": 2.0}, "update": {"loss": 0.1}}
        self.info = common_pb2.ServiceInfo(role="trainer", weight_version=version, details={
            "run_id": "run-f", "run_step": "4", "run_data_position": "16", "run_step_metrics": json.dumps(kept)})

    async def GetInfo(self, request):
        return self.info


def _recover(tmp_path, trainer) -> dict:
    store = MemoryStore()
    ctx = SimpleNamespace(trainer=trainer, cfg=SimpleNamespace(run=SimpleNamespace(checkpoint_every=0)),
                          run_dir=tmp_path, step=3, weight_version=3, data=SimpleNamespace(position=12),
                          algorithm=RL)
    record = RunRecord(run_id="run-f", config="", step=3, weight_version=3, data_position=12)
    asyncio.run(recovery.settle_trainer(store, record, ctx))
    (stored,) = asyncio.run(store.metrics("run-f"))
    (line,) = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert line == stored and asyncio.run(store.get("run-f")).step == 4
    return {k: v for k, v in stored.items() if k != "timestamp"}


def test_a_recovered_step_is_committed_with_the_metrics_the_trainer_kept_of_it(tmp_path):
    assert _recover(tmp_path, _Trainer(version=4, kept_version=4)) == {
        "reward_mean": 0.5, "time/generate": 2.0, "actor/loss": 0.1, "step": 4.0, "recovered": 1.0,
        "weight_version": 4.0, "data_position": 16.0}


def test_metrics_kept_for_another_weight_version_are_not_taken_for_the_recovered_steps(tmp_path):
    assert _recover(tmp_path, _Trainer(version=5, kept_version=4)) == {
        "step": 4.0, "recovered": 1.0, "weight_version": 5.0, "data_position": 16.0}


def _step_records(records: list[dict]) -> list[int]:
    """The steps of the per-step records (not step 0's evaluation, not the final one)."""
    return sorted(int(m["step"]) for m in records if m["step"] >= 1 and not m.get("final"))


def _tensorboard_steps(run_dir: Path, tag: str) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = []
    for events in (run_dir / "tensorboard").glob("events.*"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        steps += [e.step for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []
    return sorted(steps)


@pytest.mark.slow
@pytest.mark.redis
def test_a_coordinator_killed_after_step_ks_update_records_every_step_once_with_step_ks_metrics(
        arith_model_path, tmp_path, redis_url, monkeypatch):
    cfg = run_config(arith_model_path, tmp_path / "runs", run={"num_steps": NUM_STEPS, "checkpoint_every": 0})
    seen = {}

    def check(point, final, records, trainer_log, jsonl):
        seen["checked"] = True
        assert (final.step, final.data_position) == (NUM_STEPS, NUM_STEPS * BATCH)
        every = list(range(1, NUM_STEPS + 1))
        assert _step_records(records) == every and _step_records(jsonl) == every
        assert _tensorboard_steps(Path(final.run_dir), "reward_mean") == every
        (step_k,) = [m for m in jsonl if m["step"] == KILL_STEP and not m.get("final")]
        assert step_k["recovered"] == 1.0 and step_k["data_position"] == KILL_STEP * BATCH
        # What the coordinator measured before the update, and the update's own metrics, came back.
        assert {"reward_mean", "accuracy", "time/generate", "actor/pg_loss"} <= set(step_k), sorted(step_k)
        assert "weight_sync/gb_per_s" not in step_k          # measured after the update: lost with the coordinator
        assert sum(1 for m in jsonl if m.get("recovered")) == 1

    kill_at_each_point(cfg, tmp_path, redis_url, monkeypatch, KILL_STEP, check, points=("after_train",))
    assert seen == {"checked": True}
