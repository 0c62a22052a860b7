"""Many runs on one mesh (coordinator/runapi/sharing.py): contended pool calls go to runs in proportion to
run.priority, a run's own cap holds, a run that leaves frees its slots; trainers are held by LoRA runs together
or by one full-parameter run alone, refused by name otherwise; adapter names are stable and valid."""

from __future__ import annotations

import asyncio
import re

import pytest

from coordinator.runapi.sharing import DEFAULT_POOL_CALLS, FairScheduler, ScheduledPool, TrainerClaims, adapter_name
from services.common.errors import FailedPrecondition


async def _contend(scheduler: FairScheduler, runs: list[str], calls: int, hold: float = 0.002) -> list[str]:
    """Each run keeps `calls` calls queued; -> the order in which they were granted."""
    order: list[str] = []

    async def one(run_id: str):
        async with scheduler.slot(run_id):
            order.append(run_id)
            await asyncio.sleep(hold)

    await asyncio.gather(*(one(r) for _ in range(calls) for r in runs))
    return order


def test_contended_calls_are_granted_in_proportion_to_priority():
    scheduler = FairScheduler(capacity=1)
    scheduler.join("a", priority=3.0)
    scheduler.join("b", priority=1.0)
    order = asyncio.run(_contend(scheduler, ["a", "b"], calls=40))
    first = order[:40]                       # while both wait: 3 of a's for each of b's
    assert first.count("a") == 30 and first.count("b") == 10
    assert scheduler.granted("a") == scheduler.granted("b") == 40


def test_equal_priorities_alternate_and_a_run_alone_is_not_held_by_capacity():
    scheduler = FairScheduler(capacity=1)
    scheduler.join("a")
    scheduler.join("b")
    order = asyncio.run(_contend(scheduler, ["a", "b"], calls=10))
    assert all(order[i] != order[i + 1] for i in range(19))
    alone = FairScheduler(capacity=1)
    alone.join("only")

    async def concurrent() -> int:
        peak, now = 0, 0

        async def one():
            nonlocal peak, now
            async with alone.slot("only"):
                now += 1
                peak = max(peak, now)
                await asyncio.sleep(0.01)
                now -= 1

        await asyncio.gather(*(one() for _ in range(5)))
        return peak

    assert asyncio.run(concurrent()) == 5    # one run: every call at once, as before sharing


def test_a_runs_own_cap_holds_and_leaving_frees_its_slots():
    scheduler = FairScheduler(capacity=8)
    scheduler.join("capped", limit=2)
    scheduler.join("other")

    async def scenario():
        peak, now = 0, 0

        async def one():
            nonlocal peak, now
            async with scheduler.slot("capped"):
                now += 1
                peak = max(peak, now)
                await asyncio.sleep(0.01)
                now -= 1

        await asyncio.gather(*(one() for _ in range(6)))
        assert peak == 2
        # A run that leaves mid-call gives its slot back: the other run is not starved at capacity 1.
        tight = FairScheduler(capacity=1)
        tight.join("x")
        tight.join("y")
        started = asyncio.Event()

        async def stuck():
            async with tight.slot("x"):
                started.set()
                await asyncio.sleep(10)

        task = asyncio.create_task(stuck())
        await started.wait()
        waiter = asyncio.create_task(_contend(tight, ["y"], calls=1))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        tight.leave("x")
        assert await asyncio.wait_for(waiter, 1) == ["y"]
        task.cancel()

    asyncio.run(scenario())


def test_scheduled_pool_passes_calls_and_attributes_through():
    class Pool:
        role = "rollout"

        async def call(self, fn, *, prefer=None):
            return await fn("stub")

    async def fn(stub):
        return stub + "!"

    scheduler = FairScheduler()
    scheduler.join("r")
    pool = ScheduledPool(Pool(), scheduler, "r")
    assert pool.role == "rollout"
    assert asyncio.run(pool.call(fn)) == "stub!" and scheduler.granted("r") == 1


def test_capacity_grows_with_the_pools_replicas_so_two_runs_fan_out_over_a_large_pool():
    class Pool:
        def __init__(self, n):
            self.replicas = {f"r{i}": object() for i in range(n)}

        async def call(self, fn, *, prefer=None):
            return await fn("stub")

    scheduler = FairScheduler()
    scheduler.join("a")
    scheduler.join("b")
    small, large = ScheduledPool(Pool(3), scheduler, "a"), ScheduledPool(Pool(16), scheduler, "b")

    async def scenario():
        now = peak = 0

        async def fn(stub):
            nonlocal now, peak
            now += 1
            peak = max(peak, now)
            await asyncio.sleep(0.02)
            now -= 1

        await asyncio.gather(*(small.call(fn) for _ in range(3)))
        assert scheduler.capacity == DEFAULT_POOL_CALLS          # 3 replicas: the floor holds
        # Each run fans one step's generate out over the 16 replicas at once: 32 calls, all in flight together.
        await asyncio.gather(*(p.call(fn) for p in (large, ScheduledPool(Pool(16), scheduler, "a"))
                               for _ in range(16)))
        return peak

    assert asyncio.run(scenario()) == 32 and scheduler.capacity == 2 * 16


def test_lora_runs_share_a_trainer_and_a_full_parameter_run_holds_it_alone():
    claims = TrainerClaims()
    assert claims.claim("run-a", "t:1", None) == ""          # the first run: the trainer's run adapter
    with pytest.raises(FailedPrecondition, match="opening run 'run-a'"):
        claims.claim("run-b", "t:1", None)
    claims.settled("run-a", "t:1", lora=True)
    assert claims.claim("run-b", "t:1", None) == "run-b"
    with pytest.raises(FailedPrecondition, match=r"actor.lora: .* trains LoRA runs 'run-a', 'run-b'"):
        claims.claim("full", "t:1", False)
    assert claims.claim("elsewhere", "t:2", False) == ""
    claims.settled("elsewhere", "t:2", lora=False)
    with pytest.raises(FailedPrecondition, match="training full-parameter run 'elsewhere'"):
        claims.claim("lora", "t:2", True)
    claims.release("elsewhere")
    assert claims.claim("lora", "t:2", True) == ""


def test_adapter_names_are_stable_and_in_the_trainers_alphabet():
    rid = "arith lora/2026-12-05" + "x" * 80
    name = adapter_name(rid)
    assert name == adapter_name(rid) and len(name) <= 64 and re.match(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$", name)
    assert adapter_name("run-20261205-abc") == "run-20261205-abc"
    assert adapter_name(rid) != adapter_name(rid + "y")


def test_a_named_runs_trainer_calls_carry_its_adapter_and_calls_without_one_are_refused():
    from coordinator.training.context import GuardedTrainer
    from meshrl.v1 import common_pb2, trainer_pb2

    seen = []

    class Stub:
        def __getattr__(self, name):
            async def method(request):
                seen.append((name, request))
                return name
            return method

    trainer = GuardedTrainer(Stub(), "t:1")
    trainer.adapter = "run-b"

    async def calls():
        await trainer.TrainActor(trainer_pb2.TrainActorRequest())
        await trainer.ComputeLogProbs(common_pb2.LogProbsRequest())
        await trainer.ConfigureRun(trainer_pb2.ConfigureRunRequest())
        await trainer.PushWeights(trainer_pb2.PushWeightsRequest())
        await trainer.CreateAdapter(trainer_pb2.AdapterRequest(name="run-b"))
        for name, request in (("TrainCritic", trainer_pb2.TrainCriticRequest()),
                              ("ExportHF", trainer_pb2.CheckpointRequest(path="x"))):
            with pytest.raises(FailedPrecondition, match=f"trainer's {name} has no adapter"):
                await getattr(trainer, name)(request)

    asyncio.run(calls())
    assert [(n, r.adapter) for n, r in seen[:4]] == [("TrainActor", "run-b"), ("ComputeLogProbs", "run-b"),
                                                     ("ConfigureRun", "run-b"), ("PushWeights", "run-b")]
    assert [n for n, _ in seen] == ["TrainActor", "ComputeLogProbs", "ConfigureRun", "PushWeights", "CreateAdapter"]
