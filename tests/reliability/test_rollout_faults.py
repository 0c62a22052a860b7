"""kill -9 of a rollout replica mid-generation: the step finishes on the others, no sample lost or doubled,
and the restarted replica comes back into the pool with the run's current weights."""

import asyncio
from collections import Counter

import grpc
import pytest
import yaml

from coordinator.client import Client
from coordinator.training import phases
from meshrl.v1 import common_pb2, rollout_pb2_grpc

from tests.reliability.procs import Procs, coordinator, run_config, with_addresses, write_config

pytestmark = [pytest.mark.slow, pytest.mark.redis]


async def _logprobs(address: str, prompt_ids, response_ids) -> tuple[list[float], int]:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await rollout_pb2_grpc.RolloutStub(channel).ComputeLogProbs(common_pb2.LogProbsRequest(
            sequences=[common_pb2.TokenSequence(id="x", prompt_ids=prompt_ids, response_ids=response_ids)]),
            timeout=30)
    return list(reply.results[0].logprobs), reply.weight_version


def _record_generations(monkeypatch) -> list[tuple[int, list, list]]:
    """Every generation the loop asks for (held-out ones aside), with the step it belongs to."""
    generations: list[tuple[int, list, list]] = []
    real_generate = phases.generate

    async def recording_generate(ctx, problems, sampling=None):
        samples = await real_generate(ctx, problems, sampling)
        if sampling is None:
            generations.append((ctx.step + 1, list(problems), samples))
        return samples

    monkeypatch.setattr(phases, "generate", recording_generate)
    return generations


async def _kill_mid_generation(ctx, slow) -> int:
    """Kills the slow replica while a training step's chunk is in flight on it; returns that step once it is done."""
    for _ in range(6000):
        rep = ctx.rollout.replicas.get(slow.address)
        if ctx.step >= 1 and rep is not None and rep.load > 0:
            break
        await asyncio.sleep(0.005)
    else:
        raise AssertionError("the slow replica never had a generation in flight")
    killed_in_step = ctx.step + 1
    Procs.kill9(slow)
    for _ in range(1200):
        if ctx.step >= killed_in_step:
            break
        await asyncio.sleep(0.05)
    assert ctx.step >= killed_in_step, "the step with the killed replica did not complete"
    assert ctx.rollout.replicas[slow.address].failures >= 1   # its call failed and moved
    return killed_in_step


async def _restart_until_current(procs: Procs, slow, ctx, manager, run_id: str) -> None:
    """Restarts the killed replica on its port; waits until the pool has it back, healthy, at the run's weights."""
    await asyncio.to_thread(procs.restart, slow)
    for _ in range(1200):
        rep = ctx.rollout.replicas.get(slow.address)
        if rep and rep.healthy and rep.weight_version == ctx.weight_version and ctx.weight_version > 1:
            return
        assert run_id in manager.tasks, (await manager.get(run_id)).message
        await asyncio.sleep(0.05)
    raise AssertionError("the restarted replica did not rejoin with the current weights")


async def _pause(client: Client, manager, run_id: str) -> None:
    await asyncio.to_thread(client.pause_run, run_id)
    for _ in range(600):
        if (await manager.get(run_id)).state == "PAUSED":
            return
        await asyncio.sleep(0.05)


def test_killing_one_of_three_rollout_replicas_mid_generation_loses_no_sample_and_it_rejoins_current(
        arith_model_path, tmp_path, redis_url, monkeypatch):
    cfg = run_config(arith_model_path, tmp_path / "runs", run={"num_steps": 10_000},
                     data={"rollout_batch_size": 6}, rollout={"n": 4, "max_tokens": 8})
    path = write_config(tmp_path / "run.yaml", cfg)
    generations = _record_generations(monkeypatch)

    with Procs(path, tmp_path / "logs") as procs:
        # The third replica decodes one row at a time: its chunk is in flight long enough to be killed in.
        trainer, reward, fast1, fast2, slow = procs.start_all(
            [("trainer", []), ("reward", []), ("rollout", []), ("rollout", []),
             ("rollout", ["--rollout.max_batch_size", "1"])])
        addresses = {"trainer": [trainer.address], "reward": [reward.address],
                     "rollout": [fast1.address, fast2.address, slow.address]}

        async def main():
            async with coordinator(redis_url) as (engine, client):
                run_id = await asyncio.to_thread(client.start_run, yaml.safe_dump(with_addresses(cfg, addresses)))
                ctx = engine.manager.contexts[run_id]
                killed_in_step = await _kill_mid_generation(ctx, slow)

                step, problems, samples = next(g for g in generations if g[0] == killed_in_step)
                expected = Counter({f"{p.id}#{g}": cfg["rollout"]["n"] for g, p in enumerate(problems)})
                assert Counter(s.id for s in samples) == expected       # nothing lost, nothing twice
                assert len(samples) == 6 * 4
                metrics = await engine.manager.metrics(run_id, killed_in_step)
                assert metrics[0]["step"] == killed_in_step and metrics[0]["num_samples"] == 24

                await _restart_until_current(procs, slow, ctx, engine.manager, run_id)
                await _pause(client, engine.manager, run_id)
                version = ctx.weight_version
                services = await asyncio.to_thread(client.list_services, run_id)
                restarted = next(r for r in services if r.address == slow.address)
                assert restarted.healthy and restarted.weight_version == version
                # Same weights as a replica that never went away: identical log-probs on the same tokens.
                sample = samples[0]
                theirs, v1 = await _logprobs(fast1.address, sample.prompt_ids, sample.response_ids)
                ours, v2 = await _logprobs(slow.address, sample.prompt_ids, sample.response_ids)
                assert v1 == v2 == version
                assert ours == theirs
                await asyncio.to_thread(client.stop_run, run_id)
                final = await asyncio.to_thread(client.wait, run_id)
                assert final.state == "STOPPED"
                steps = [int(m["step"]) for m in await engine.manager.metrics(run_id) if "reward_mean" in m]
                assert steps == list(range(1, final.step + 1))

        asyncio.run(main())
