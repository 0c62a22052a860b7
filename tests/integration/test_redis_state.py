"""Run state and the service registry against a real Redis on 127.0.0.1:6379."""

import asyncio
import uuid

import pytest

from coordinator.runapi.store import RedisStore, RunRecord
from services.common.rpc.registry import Registry

pytestmark = pytest.mark.redis


def test_run_records_and_metrics_survive_a_new_store_connection(redis_url):
    async def main():
        run_id = f"test-{uuid.uuid4().hex[:8]}"
        store = RedisStore(redis_url, prefix=f"meshrl-test-{run_id}")
        await store.put(RunRecord(run_id=run_id, config="run: {num_steps: 3}", state="RUNNING", step=2,
                                  data_position=16, weight_version=2))
        await store.append_metrics(run_id, {"step": 1, "reward_mean": 0.5})
        await store.append_metrics(run_id, {"step": 2, "reward_mean": 0.75})
        await store.close()
        again = RedisStore(redis_url, prefix=f"meshrl-test-{run_id}")
        rec = await again.get(run_id)
        assert (rec.state, rec.step, rec.data_position, rec.weight_version) == ("RUNNING", 2, 16, 2)
        assert [m["step"] for m in await again.metrics(run_id, from_step=2)] == [2]
        assert [r.run_id for r in await again.list()] == [run_id]
        await again.close()

    asyncio.run(main())


def test_registry_join_and_leave_with_heartbeats(redis_url):
    async def main():
        prefix = f"meshrl-test-{uuid.uuid4().hex[:8]}"
        ttl = 1.5
        reg = Registry(redis_url, prefix=prefix, ttl_s=ttl)
        beats: dict[str, list[float]] = {"10.0.0.1:1": [], "10.0.0.2:1": []}
        beat = asyncio.Event()
        register = reg.register

        async def counted(role, address):  # every heartbeat's registration, as it lands
            await register(role, address)
            beats[address].append(asyncio.get_running_loop().time())
            beat.set()

        reg.register = counted

        async def next_beat_of(address):
            seen = len(beats[address])
            while len(beats[address]) == seen:
                beat.clear()
                await asyncio.wait_for(beat.wait(), 30)

        stop_a, stop_b = asyncio.Event(), asyncio.Event()
        a = asyncio.create_task(reg.heartbeat("rollout", "10.0.0.1:1", stop_a))
        b = asyncio.create_task(reg.heartbeat("rollout", "10.0.0.2:1", stop_b))
        while not all(beats.values()):
            await next_beat_of("10.0.0.1:1" if not beats["10.0.0.1:1"] else "10.0.0.2:1")
        assert await reg.list("rollout") == ["10.0.0.1:1", "10.0.0.2:1"]
        # a graceful stop deregisters at once
        stop_a.set()
        await a
        assert await reg.list("rollout") == ["10.0.0.2:1"]
        # heartbeats keep b alive past its TTL: registered at its first beat, listed after beats spanning 2 TTLs
        while beats["10.0.0.2:1"][-1] - beats["10.0.0.2:1"][0] < 2 * ttl:
            await next_beat_of("10.0.0.2:1")
        assert len(beats["10.0.0.2:1"]) >= 4
        assert await reg.list("rollout") == ["10.0.0.2:1"]
        # a replica that dies without deregistering disappears when its TTL runs out (and only then)
        b.cancel()
        listed_after_death = []
        for _ in range(300):  # a bound on polls, not on seconds
            listed_after_death.append(await reg.list("rollout"))
            if not listed_after_death[-1]:
                break
            await asyncio.sleep(ttl / 10)
        assert listed_after_death[0] == ["10.0.0.2:1"] and listed_after_death[-1] == []
        await reg.close()

    asyncio.run(main())
