"""The run API end to end: a script drives a run with the Python client; each algorithm runs 3 steps."""

import asyncio
import json
from pathlib import Path

import grpc
import pytest
import yaml

from coordinator.client import Client
from coordinator.runapi.service import CoordinatorSettings, start as start_coordinator
from services.common.config import load_config
from services.local import start_local_mesh

pytestmark = pytest.mark.slow


def base_config(model_path: str, run_dir: Path, **sections) -> dict:
    cfg = {
        "model": {"path": model_path},
        "rollout": {"n": 4, "temperature": 1.0, "max_tokens": 6},
        "actor": {"lr": 1e-5},
        "algorithm": {"adv_estimator": "grpo"},
        "data": {"train_files": ["examples/arith/data/train.jsonl"],
                 "heldout_files": ["examples/arith/data/heldout.jsonl"], "heldout_size": 8, "rollout_batch_size": 2},
        "run": {"num_steps": 3, "run_dir": str(run_dir)},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return cfg


async def with_mesh(config: dict, body, *, num_rollout: int = 2):
    mesh = await start_local_mesh(config, num_rollout=num_rollout)
    server, port, engine = await start_coordinator(load_config(CoordinatorSettings, data={}), "127.0.0.1:0")
    try:
        return await body(mesh, f"127.0.0.1:{port}")
    finally:
        await engine.close()
        await server.stop(0)
        await mesh.stop()


def test_a_script_starts_streams_pauses_resumes_and_stops_a_run(arith_model_path, tmp_path):
    config = base_config(arith_model_path, tmp_path, run={"num_steps": 50})

    async def body(mesh, address):
        client = Client(address)
        run_id = await asyncio.to_thread(client.start_run, yaml.safe_dump(mesh.config))

        def first_steps():
            seen = []
            for m in client.stream_metrics(run_id):
                seen.append(m)
                if sum("reward_mean" in x for x in seen) >= 2:
                    return seen

        seen = await asyncio.to_thread(first_steps)
        assert seen[0]["step"] == 0 and "heldout_accuracy" in seen[0]
        assert [m["step"] for m in seen if "reward_mean" in m] == [1, 2]
        status = await asyncio.to_thread(client.pause_run, run_id)
        for _ in range(100):
            status = await asyncio.to_thread(client.get_run, run_id)
            if status.state == "PAUSED":
                break
            await asyncio.sleep(0.1)
        assert status.state == "PAUSED"
        paused_at = status.step
        await asyncio.sleep(1.0)
        assert (await asyncio.to_thread(client.get_run, run_id)).step == paused_at
        assert (await asyncio.to_thread(client.resume_run, run_id)).state == "RUNNING"
        for _ in range(200):
            status = await asyncio.to_thread(client.get_run, run_id)
            if status.step > paused_at:
                break
            await asyncio.sleep(0.1)
        assert status.step > paused_at
        await asyncio.to_thread(client.stop_run, run_id)
        final = await asyncio.to_thread(client.wait, run_id)
        assert final.state == "STOPPED" and final.step < 50
        runs = await asyncio.to_thread(client.list_runs)
        assert [r.run_id for r in runs] == [run_id]
        records = [json.loads(line) for line in (Path(final.run_dir) / "metrics.jsonl").read_text().splitlines()]
        steps = [int(r["step"]) for r in records if "reward_mean" in r]
        assert steps == list(range(1, final.step + 1))        # no gap, no repeat
        with pytest.raises(grpc.RpcError) as err:
            await asyncio.to_thread(client.get_run, "no-such-run")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        client.close()

    asyncio.run(with_mesh(config, body))


def test_bad_config_fails_start_run_naming_the_key_before_any_service_is_called(arith_model_path, tmp_path):
    async def body(mesh, address):
        client = Client(address)
        for bad, key in ((dict(mesh.config, rollout={**mesh.config["rollout"], "n": 0}), "rollout.n"),
                         (dict(mesh.config, algorithm={"adv_estimator": "grpo", "bogus": 1}), "algorithm.bogus"),
                         (dict(mesh.config, reward={"servers": ["127.0.0.1:1"]}), "reward.servers")):
            with pytest.raises(grpc.RpcError) as err:
                await asyncio.to_thread(client.start_run, yaml.safe_dump(bad))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert key in err.value.details()
        assert await asyncio.to_thread(client.list_runs) == []
        client.close()

    asyncio.run(with_mesh(base_config(arith_model_path, tmp_path), body, num_rollout=1))


@pytest.mark.parametrize("estimator,extra", [
    ("grpo", {}),
    ("rloo", {}),
    ("reinforce_plus_plus", {}),
    ("reinforce_plus_plus_baseline", {}),
    ("gae", {"critic": {"lr": 1e-4}}),
])
def test_each_algorithm_runs_three_steps_end_to_end(arith_model_path, tmp_path, estimator, extra):
    config = base_config(arith_model_path, tmp_path, algorithm={"adv_estimator": estimator, "use_kl_loss": True,
                                                                "logprob_parity_every": 1},
                         **extra)

    async def body(mesh, address):
        client = Client(address)
        run_id = await asyncio.to_thread(client.start_run, yaml.safe_dump(mesh.config))
        final = await asyncio.to_thread(client.wait, run_id)
        assert final.state == "COMPLETED", final.message
        assert final.step == 3 and final.weight_version == 3
        records = [json.loads(line) for line in (Path(final.run_dir) / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in records if "reward_mean" in r]
        assert len(steps) == 3
        for r in steps:
            assert r["rollout_vs_trainer/logprob_abs_diff"] < 1e-3
            assert r["time/generate"] > 0 and r["time/train"] > 0 and r["time/weight_sync"] > 0
            if estimator == "gae":
                assert "critic/value_loss" in r or any(k.startswith("critic/") for k in r)
        summary = json.loads((Path(final.run_dir) / "summary.json").read_text())
        assert summary["steps"] == 3 and 0.0 <= summary["heldout_accuracy_after"] <= 1.0
        client.close()

    asyncio.run(with_mesh(config, body))


def test_async_mode_overlaps_generation_and_reports_staleness(arith_model_path, tmp_path):
    config = base_config(arith_model_path, tmp_path, run={"num_steps": 4, "async_mode": True, "max_staleness": 1})

    async def body(mesh, address):
        client = Client(address)
        run_id = await asyncio.to_thread(client.start_run, yaml.safe_dump(mesh.config))
        final = await asyncio.to_thread(client.wait, run_id)
        assert final.state == "COMPLETED", final.message
        records = [json.loads(line) for line in (Path(final.run_dir) / "metrics.jsonl").read_text().splitlines()]
        stale = [r["staleness_max"] for r in records if "reward_mean" in r]
        assert stale[0] == 0 and max(stale) == 1 and all(s <= 1 for s in stale)
        client.close()

    asyncio.run(with_mesh(config, body))


def test_a_run_started_with_an_empty_config_writes_under_the_coordinators_run_dir(tmp_path):
    # As `meshrl mesh --run-dir DIR` starts it: the coordinator's run.run_dir and the mesh's services as its pools.
    runs = tmp_path / "mesh-runs"

    async def main():
        mesh = await start_local_mesh({"rollout": {"max_tokens": 6}}, num_rollout=1)
        pools = {role: {"servers": mesh.addresses[role]} for role in ("rollout", "reward", "reference")}
        settings = load_config(CoordinatorSettings, data={"run": {"run_dir": str(runs)}, **pools,
                                                          "trainer": {"address": mesh.addresses["trainer"][0]}})
        server, port, engine = await start_coordinator(settings, "127.0.0.1:0")
        client = Client(f"127.0.0.1:{port}")
        try:
            run_id = await asyncio.to_thread(client.start_run, "")
            started = await asyncio.to_thread(client.get_run, run_id)
            await asyncio.to_thread(client.stop_run, run_id)
            return run_id, started, await asyncio.to_thread(client.wait, run_id)
        finally:
            client.close()
            await engine.close()
            await server.stop(0)
            await mesh.stop()

    run_id, started, final = asyncio.run(main())
    assert started.run_dir == str(runs / run_id)
    assert (runs / run_id / "recipe.yaml").is_file() and final.state == "STOPPED"
    assert yaml.safe_load(started.config)["run"]["run_dir"] == str(runs)   # the effective config says where
    assert not (Path("runs") / run_id).exists()
