"""kill -9 of the trainer and of a rollout replica under the async loop (run.async_mode, max_staleness 2): every step
1..N recorded once (store and metrics.jsonl) and every prompt group trained exactly once, by the ledger's settled
log (a replayed step's earlier marks go with its rollback); the coordinator kills are in test_async_exactly_once.py."""

import asyncio
import json
import uuid
from pathlib import Path

import pytest
import yaml

from coordinator.client import Client
from tests.reliability.procs import (LEDGER_OK, Procs, coordinator, ledger_report, run_config, wait_until,
                                     with_addresses, write_config)

pytestmark = [pytest.mark.slow, pytest.mark.redis]

BATCH = 4                   # data.rollout_batch_size of run_config
N = 4                       # rollout.n of run_config


def _steps(records: list[dict]) -> list[int]:
    return sorted(int(m["step"]) for m in records if "reward_mean" in m or m.get("recovered"))


def _jsonl(run_dir: str) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_a_killed_trainer_replays_the_async_run_from_its_checkpoint_training_each_group_once(
        arith_model_path, tmp_path, redis_url):
    num_steps = 6
    cfg = run_config(arith_model_path, tmp_path / "runs", run={"num_steps": num_steps, "checkpoint_every": 2,
                                                               "async_mode": True, "max_staleness": 2})
    prefix = f"meshrl-async-{uuid.uuid4().hex[:8]}"
    with Procs(write_config(tmp_path / "run.yaml", cfg), tmp_path / "logs") as procs:
        trainer, reward, rollout = procs.start_all([("trainer", []), ("reward", []), ("rollout", [])])
        addresses = {"trainer": [trainer.address], "reward": [reward.address], "rollout": [rollout.address]}
        coord = procs.start("coordinator", args=["--run.redis_url", redis_url, "--run.redis_prefix", prefix])
        with Client(coord.address) as client:
            run_id = client.start_run(yaml.safe_dump(with_addresses(cfg, addresses)))
            wait_until(lambda: client.get_run(run_id).step >= 3, 300, "three completed steps")
            Procs.kill9(trainer)
            paused = wait_until(lambda: (s := client.get_run(run_id)).state in ("PAUSED", "FAILED") and s, 120,
                                "the run to notice the trainer is gone")
            assert paused.state == "PAUSED", paused.message
            procs.restart(trainer)                     # a fresh process: the run goes back to its checkpoint
            assert client.resume_run(run_id).state == "RUNNING"
            final = client.wait(run_id)
            records = list(client.stream_metrics(run_id))
        assert final.state == "COMPLETED", final.message
        assert (final.step, final.data_position, final.weight_version) == (num_steps, num_steps * BATCH, num_steps)
        assert "replaying from step" in Procs.log(coord)
        expected = list(range(1, num_steps + 1))
        assert _steps(records) == expected and _steps(_jsonl(final.run_dir)) == expected
        # The steps after the checkpoint trained again on the same groups: their first marks went with the
        # rollback, so the settled log names each group once.
        assert ledger_report(redis_url, prefix, run_id, num_steps, BATCH) == LEDGER_OK
        assert all(0 <= m["staleness_max"] <= 2 for m in records if "reward_mean" in m)


async def _kill_mid_generation(ctx, victim) -> int:
    """Kills `victim` while a generation of the run is in flight on it (after step 1); -> the step in progress."""
    for _ in range(6000):
        rep = ctx.rollout.replicas.get(victim.address)
        if ctx.step >= 1 and rep is not None and rep.load > 0:
            break
        await asyncio.sleep(0.005)
    else:
        raise AssertionError("the replica never had a generation in flight")
    killed_in = ctx.step + 1
    Procs.kill9(victim)
    for _ in range(1200):                  # its call in flight fails and moves to the other replica
        rep = ctx.rollout.replicas.get(victim.address)
        if rep is not None and rep.failures >= 1:
            return killed_in
        await asyncio.sleep(0.05)
    raise AssertionError("no call failed on the killed replica")


def test_a_rollout_replica_killed_mid_generation_with_partial_rollouts_loses_no_group_and_trains_none_twice(
        arith_model_path, tmp_path, redis_url):
    num_steps = 5
    cfg = run_config(arith_model_path, tmp_path / "runs", run={"num_steps": num_steps, "async_mode": True,
                                                               "max_staleness": 2},
                     rollout={"partial_rollouts": "continue"})
    with Procs(write_config(tmp_path / "run.yaml", cfg), tmp_path / "logs") as procs:
        # The victim decodes one row at a time: its chunks stay in flight long enough to be killed in.
        trainer, reward, steady, victim = procs.start_all(
            [("trainer", []), ("reward", []), ("rollout", []), ("rollout", ["--rollout.max_batch_size", "1"])])
        addresses = {"trainer": [trainer.address], "reward": [reward.address],
                     "rollout": [steady.address, victim.address]}

        async def main():
            async with coordinator(redis_url) as (engine, client):
                run_id = await asyncio.to_thread(client.start_run, yaml.safe_dump(with_addresses(cfg, addresses)))
                ctx = engine.manager.contexts[run_id]
                killed_in = await _kill_mid_generation(ctx, victim)
                final = await asyncio.to_thread(client.wait, run_id)
                store = engine.manager.store
                return killed_in, final, await store.metrics(run_id), await store.ledger(run_id).settled()

        killed_in, final, records, settled = asyncio.run(main())
    assert final.state == "COMPLETED", final.message
    assert killed_in <= num_steps
    expected = list(range(1, num_steps + 1))
    assert _steps(records) == expected and _steps(_jsonl(final.run_dir)) == expected
    # Every step trained on its whole batch: no sample of the killed replica's chunks lost or doubled.
    assert [m["num_samples"] for m in records if "reward_mean" in m] == [BATCH * N] * num_steps
    assert [(line["step"], line["trained"]) for line in settled] == \
        [(s, list(range((s - 1) * BATCH, s * BATCH))) for s in expected]
    assert all(set(line) == {"step", "trained"} for line in settled)
