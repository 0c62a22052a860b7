"""Run state and the service registry against a real Redis on 127.0.0.1:6379."""

import asyncio
import uuid

import pytest

from coordinator.store import RedisStore, RunRecord
from services.common.registry import Registry

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
        reg = Registry(redis_url, prefix=prefix, ttl_s=0.6)
        stop_a, stop_b = asyncio.Event(), asyncio.Event()
        a = asyncio.create_task(reg.heartbeat("rollout", "10.0.0.1:1", stop_a))
        b = asyncio.create_task(reg.heartbeat("rollout", "10.0.0.2:1", stop_b))
        await asyncio.sleep(0.1)
        assert await reg.list("rollout") == ["10.0.0.1:1", "10.0.0.2:1"]
        # a graceful stop deregisters at once
        stop_a.set()
        await a
        assert await reg.list("rollout") == ["10.0.0.2:1"]
        # heartbeats keep b alive past its TTL
        await asyncio.sleep(1.0)
        assert await reg.list("rollout") == ["10.0.0.2:1"]
        # a replica that dies without deregistering disappears when its TTL runs out
        b.cancel()
        await asyncio.sleep(0.8)
        assert await reg.list("rollout") == []
        await reg.close()

    asyncio.run(main())
