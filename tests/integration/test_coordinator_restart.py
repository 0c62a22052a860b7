"""A restarted coordinator resumes every unfinished run from its last completed step (Redis state)."""

import asyncio
import json
import uuid
from pathlib import Path

import pytest
import yaml

from coordinator.client import Client
from coordinator.runapi.service import CoordinatorSettings, start as start_coordinator
from coordinator.runapi.store import RedisStore
from services.common.config import load_config
from services.local import start_local_mesh

from tests.integration.test_coordinator_run_api import base_config

pytestmark = [pytest.mark.slow, pytest.mark.redis]


def test_coordinator_restart_resumes_from_the_last_completed_step(arith_model_path, tmp_path, redis_url):
    prefix = f"meshrl-test-{uuid.uuid4().hex[:8]}"
    settings = load_config(CoordinatorSettings, data={"run": {"redis_url": redis_url, "redis_prefix": prefix}})
    config = base_config(arith_model_path, tmp_path, run={"num_steps": 6})

    async def main():
        mesh = await start_local_mesh(config, num_rollout=2)
        try:
            server, port, engine = await start_coordinator(settings, "127.0.0.1:0")
            client = Client(f"127.0.0.1:{port}")
            run_id = await asyncio.to_thread(client.start_run, yaml.safe_dump(mesh.config))
            for _ in range(600):
                status = await asyncio.to_thread(client.get_run, run_id)
                if status.step >= 2:
                    break
                await asyncio.sleep(0.05)
            # The coordinator dies without any chance to record a clean state.
            await engine.close()
            await server.stop(0)
            client.close()
            store = RedisStore(redis_url, prefix=prefix)
            killed = await store.get(run_id)
            assert killed.state == "RUNNING" and killed.step >= 2
            await store.close()

            server, port, engine = await start_coordinator(settings, "127.0.0.1:0")
            client = Client(f"127.0.0.1:{port}")
            final = await asyncio.to_thread(client.wait, run_id)
            assert final.state == "COMPLETED", final.message
            # Killed after the trainer applied an update that was never recorded, the run commits that step as
            # recovered instead of training it again (coordinator/runapi/recovery.py): versions line up exactly.
            assert final.step == 6 and final.weight_version == 6
            trainer_version = mesh.engines["trainer"][0].rank.weight_version
            assert final.weight_version == trainer_version
            for replica in mesh.engines["rollout"]:
                assert replica.engine.weight_version == trainer_version
            assert final.data_position == 6 * 2
            records = [json.loads(line) for line in
                       (Path(final.run_dir) / "metrics.jsonl").read_text().splitlines()]
            steps = [int(r["step"]) for r in records if "reward_mean" in r or r.get("recovered")]
            assert steps == [1, 2, 3, 4, 5, 6]
            store_steps = [int(m["step"]) for m in await asyncio.to_thread(lambda: list(client.stream_metrics(run_id)))
                           if "reward_mean" in m or m.get("recovered")]
            assert store_steps == [1, 2, 3, 4, 5, 6]
            client.close()
            await engine.close()
            await server.stop(0)
        finally:
            await mesh.stop()

    asyncio.run(main())
