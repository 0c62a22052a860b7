"""Exactly-once steps: the trainer records the run step of each update, and a coordinator killed at any point
of a step resumes without a step missing, repeated or trained twice, and without a prompt used twice."""

import asyncio
import re
import uuid
from types import SimpleNamespace

import pytest

from coordinator.training import faults

from coordinator.runapi import recovery
from coordinator.runapi.store import MemoryStore, RedisStore, RunRecord
from coordinator.training.faults import KILL_POINTS
from meshrl.v1 import common_pb2
from services.common.config import load_config
from services.common.errors import FailedPrecondition
from services.common.tensors.weights import named_weights
from services.trainer.config import TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.testing import make_tiny_model, random_samples
from services.trainer.types import ActorLoss, CriticLoss, CriticSample, RunStep

from tests.reliability.procs import kill_at_each_point, run_config

NUM_STEPS = 5
KILL_STEP = 3
BATCH = 4                   # data.rollout_batch_size of run_config


# --- the trainer's record ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory) -> TrainerEngine:
    path = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    return TrainerEngine(load_config(TrainerSettings, data={"model": {"path": path}, "actor": {"lr": 1e-2}}))


def _weights(e: TrainerEngine) -> dict:
    return {k: v.detach().clone() for k, v in named_weights(e.rank.actor.module).items()}


def test_a_repeated_run_step_is_answered_from_the_record_without_training_again(tiny_engine):
    e = tiny_engine
    first = RunStep("run-a", 1, 4)
    metrics, repeated = e.train_actor_step(random_samples(4, seed=0), ActorLoss(), first)
    version, weights = e.rank.weight_version, _weights(e)
    again, repeated_again = e.train_actor_step(random_samples(4, seed=1), ActorLoss(), first)
    assert (repeated, repeated_again) == (False, True)
    assert again == metrics and e.rank.weight_version == version
    assert all(weights[k].equal(v) for k, v in _weights(e).items())
    assert {k: e.info()[k] for k in ("run_id", "run_step", "run_data_position")} == \
        {"run_id": "run-a", "run_step": 1, "run_data_position": 4}


def test_a_run_step_out_of_order_is_refused_by_name_and_another_run_starts_anywhere(tiny_engine):
    e = tiny_engine
    e.train_actor_step(random_samples(4, seed=2), ActorLoss(), RunStep("run-b", 1, 4))
    version = e.rank.weight_version
    with pytest.raises(FailedPrecondition) as err:
        e.train_actor_step(random_samples(4, seed=3), ActorLoss(), RunStep("run-b", 3, 12))
    assert str(err.value) == ("run_step.step: run 'run-b' step 3 does not follow the step this trainer last "
                              "applied (1); the run must resume from a checkpoint")
    assert e.rank.weight_version == version
    e.train_actor_step(random_samples(4, seed=4), ActorLoss(), RunStep("run-c", 7, 28))
    assert e.rank.weight_version == version + 1 and e.info()["run_step"] == 7


def test_a_checkpoint_reports_the_run_step_it_holds_and_a_load_makes_it_the_record(tiny_engine, tmp_path):
    e = tiny_engine
    e.train_actor_step(random_samples(4, seed=5), ActorLoss(), RunStep("run-d", 1, 4))
    saved = e.save_checkpoint(str(tmp_path / "ck"))
    assert saved["run_step"] == RunStep("run-d", 1, 4)
    e.train_actor_step(random_samples(4, seed=6), ActorLoss(), RunStep("run-d", 2, 8))
    e.load_checkpoint(str(tmp_path / "ck"), RunStep("run-d", 1, 4))
    assert e.info()["run_step"] == 1
    _, repeated = e.train_actor_step(random_samples(4, seed=6), ActorLoss(), RunStep("run-d", 2, 8))
    assert not repeated and e.info()["run_step"] == 2


def test_a_critic_update_of_a_step_redone_is_not_applied_twice(tmp_path):
    path = make_tiny_model(tmp_path / "model")
    e = TrainerEngine(load_config(TrainerSettings, data={"model": {"path": path}, "actor": {"lr": 1e-2},
                                                         "critic": {"lr": 1e-2}}))
    samples = [CriticSample([1, 5], [3, 4], [1.0, 1.0])]
    step = RunStep("run-e", 1, 4)
    _, first = e.train_critic_step(samples, CriticLoss(), step)
    values = e.compute_values([[1, 5]], [[3, 4]])
    # The coordinator died before the step's actor update: the redone step's critic call is a repeat.
    _, again = e.train_critic_step(samples, CriticLoss(), step)
    assert (first, again) == (False, True) and e.rank.critic.step == 1
    assert e.compute_values([[1, 5]], [[3, 4]]) == values


# --- the coordinator's side, against a trainer that only answers GetInfo -----------------------------------

class _InfoOnly:
    """A trainer stub whose GetInfo reports `details` at `weight_version`."""

    def __init__(self, weight_version: int, **details):
        self.info = common_pb2.ServiceInfo(role="trainer", weight_version=weight_version,
                                           details={k: str(v) for k, v in details.items()})

    async def GetInfo(self, request):
        return self.info


def _reopened(tmp_path, trainer, step: int):
    cfg = SimpleNamespace(run=SimpleNamespace(checkpoint_every=0))
    ctx = SimpleNamespace(trainer=trainer, cfg=cfg, run_dir=tmp_path, step=step, weight_version=step,
                          data=SimpleNamespace(position=step * BATCH))
    return RunRecord(run_id="run-f", config="", step=step, weight_version=step, data_position=step * BATCH), ctx


async def _committed(store: MemoryStore, record: RunRecord) -> None:
    for step in range(record.step + 1):
        await store.commit(record, {"step": step, "reward_mean": 0.0})


def test_a_fresh_trainer_without_a_checkpoint_replays_the_run_from_step_zero_and_drops_the_later_metrics(tmp_path):
    store = MemoryStore()
    record, ctx = _reopened(tmp_path, _InfoOnly(0), step=3)
    asyncio.run(_committed(store, record))
    asyncio.run(recovery.settle_trainer(store, record, ctx))
    stored = asyncio.run(store.get("run-f"))
    assert (stored.step, stored.data_position, stored.weight_version) == (0, 0, 0)
    assert (ctx.step, ctx.data.position) == (0, 0)
    assert [m["step"] for m in asyncio.run(store.metrics("run-f"))] == [0]
    assert stored.message == ("the trainer lost its weights: steps 1..3 replayed from the trainer's initial "
                              "weights: the run has no checkpoint (run.checkpoint_every: 0)")


def test_a_trainer_holding_other_weights_without_a_checkpoint_is_refused_by_name(tmp_path):
    record, ctx = _reopened(tmp_path, _InfoOnly(9, run_id="another-run", run_step=9), step=3)
    with pytest.raises(FailedPrecondition) as err:
        asyncio.run(recovery.settle_trainer(MemoryStore(), record, ctx))
    assert str(err.value) == ("run 'run-f': the trainer holds no weights of step 3 and the run has no checkpoint "
                              "(run.checkpoint_every: 0); restart the trainer to replay the run from step 0")


def test_a_step_the_trainer_applied_but_the_store_missed_is_committed_as_recovered(tmp_path):
    store = MemoryStore()
    record, ctx = _reopened(tmp_path, _InfoOnly(4, run_id="run-f", run_step=4, run_data_position=16), step=3)
    asyncio.run(recovery.settle_trainer(store, record, ctx))
    stored = asyncio.run(store.get("run-f"))
    assert (stored.step, stored.data_position, stored.weight_version) == (4, 16, 4)
    (last,) = asyncio.run(store.metrics("run-f"))
    assert (last["step"], last["recovered"], last["weight_version"]) == (4.0, 1.0, 4.0)


@pytest.mark.redis
def test_a_redis_rollback_drops_the_later_steps_metrics_and_sets_the_record_at_once(redis_url):
    async def main():
        store = RedisStore(redis_url, prefix=f"meshrl-once-{uuid.uuid4().hex[:8]}")
        record = RunRecord(run_id="run-g", config="", step=4)
        for step in range(5):
            await store.commit(record, {"step": step, "reward_mean": 0.0})
        record.step = 2
        await store.rollback(record)
        steps = [m["step"] for m in await store.metrics("run-g")]
        stored = await store.get("run-g")
        await store.close()
        return steps, stored.step

    assert asyncio.run(main()) == ([0, 1, 2], 2)


# --- kill -9 of the coordinator at each point of a step --------------------------------------------------

def test_a_malformed_kill_point_setting_is_refused_by_its_name():
    with pytest.raises(ValueError) as err:
        faults._parse("after_lunch:step3")
    assert str(err.value) == ("MESHRL_TEST_KILL_AT: expected POINT:stepN with POINT one of after_generate, "
                              "after_train, after_sync, after_commit, got 'after_lunch:step3'")
    assert faults._parse("after_sync:step3") == ("after_sync", 3) and faults._parse("") is None


def _applied(trainer_log: str, run_id: str) -> list[tuple[int, int]]:
    """(step, data position) of every update the trainer applied for the run, from its audit lines."""
    return [(int(m.group(1)), int(m.group(2))) for m in
            re.finditer(rf"applied run {re.escape(run_id)} step (\d+) \(data position (\d+)\)", trainer_log)]


def _count(records: list[dict]) -> dict[str, int]:
    """Steps missing, repeated and recorded among the step records (training metrics or a recovered commit)."""
    steps = [int(m["step"]) for m in records if "reward_mean" in m or m.get("recovered")]
    return {"missing": len(set(range(1, NUM_STEPS + 1)) - set(steps)), "repeated": len(steps) - len(set(steps))}


def _report(point: str, records: list[dict], applied: list[tuple[int, int]]) -> dict[str, int]:
    steps = [s for s, _ in applied]
    positions = [p for _, p in applied]
    return {**_count(records), "trained_twice": len(steps) - len(set(steps)),
            # Each update used the BATCH prompts before its data position: every position once, none skipped.
            "prompts_twice": len(positions) - len(set(positions)),
            "prompts_skipped": int(sorted(positions) != [BATCH * s for s in range(1, NUM_STEPS + 1)])}


@pytest.mark.slow
@pytest.mark.redis
def test_a_coordinator_killed_at_each_point_of_a_step_trains_every_step_and_prompt_exactly_once(
        arith_model_path, tmp_path, redis_url, monkeypatch):
    cfg = run_config(arith_model_path, tmp_path / "runs", run={"num_steps": NUM_STEPS, "checkpoint_every": 3})
    reports = {}

    def check(point, final, records, trainer_log, jsonl):
        assert (final.step, final.data_position) == (NUM_STEPS, NUM_STEPS * BATCH), point
        reports[point] = _report(point, records, _applied(trainer_log, final.run_id))
        recovered = [int(m["step"]) for m in records if m.get("recovered")]
        # A kill between the update and its commit: that step is committed as recovered, not trained again.
        assert recovered == ([KILL_STEP] if point in ("after_train", "after_sync") else []), point
        assert _count(jsonl) == {"missing": 0, "repeated": 0}, point

    kill_at_each_point(cfg, tmp_path, redis_url, monkeypatch, KILL_STEP, check)
    print("\nkill point      missing repeated trained_twice prompts_twice prompts_skipped")
    for point, r in reports.items():
        print(f"{point:15s} {r['missing']:7d} {r['repeated']:8d} {r['trained_twice']:13d} {r['prompts_twice']:13d} "
              f"{r['prompts_skipped']:15d}")
    zero = {"missing": 0, "repeated": 0, "trained_twice": 0, "prompts_twice": 0, "prompts_skipped": 0}
    assert reports == {point: zero for point in KILL_POINTS}
