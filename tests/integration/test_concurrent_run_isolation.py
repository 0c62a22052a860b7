"""Runs beside each other on one mesh keep apart (docs/many_runs.md): one paused or failed leaves the others'
steps going; a named adapter's run resumes from its own checkpoint; a run beside a full-parameter run is refused by
name with FAILED_PRECONDITION."""

import asyncio

import pytest
import yaml

from coordinator.runapi.runs import RunManager
from coordinator.runapi.store import MemoryStore
from coordinator.training import remote
from meshrl.v1 import trainer_pb2
from services.common.errors import FailedPrecondition
from services.local import start_local_mesh
from tests.integration.test_concurrent_runs import REPO, lora_recipe

pytestmark = pytest.mark.slow


async def _until(predicate, timeout: float = 120.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


def _run(config: dict, name: str, steps: int, lr: float, **run) -> str:
    out = {**config, "run": {**config["run"], "name": name, "num_steps": steps, **run},
           "actor": {**config["actor"], "lr": lr}}
    return yaml.safe_dump(out)


def test_a_paused_or_failed_run_leaves_the_others_running_and_a_named_run_resumes_from_its_checkpoint(tmp_path):
    async def main():
        mesh = await start_local_mesh(lora_recipe(tmp_path / "runs"), num_rollout=1, num_reference=0)
        manager = RunManager(MemoryStore())
        try:
            a = await manager.start_run(_run(mesh.config, "a", 40, 1e-3))
            b = await manager.start_run(_run(mesh.config, "b", 3, 3e-4, checkpoint_every=1, priority=3.0,
                                             max_pool_calls=2))
            share = manager.schedulers["rollout"].shares[b]     # the shared pools grant b by its priority and cap
            assert (share.priority, share.limit) == (3.0, 2) and manager.schedulers["reward"].shares[a].priority == 1
            c = await manager.start_run(_run(mesh.config, "c", 40, 1e-3))
            recs = {r: await manager.get(r) for r in (a, b, c)}
            assert recs[a].adapter == "" and recs[b].adapter and recs[c].adapter
            # The trainer through a's channels: c's close when c fails, which can be before DeleteAdapter answers
            # (it unloads the adapter from the replicas too), and would cancel the call.
            trainer = manager.contexts[a].trainer
            held = (await remote.info(trainer)).details["named_adapters"]
            assert set(held.split(",")) == {recs[b].adapter, recs[c].adapter}
            # c fails: its adapter vanishes under it. DeleteAdapter also unloads it from the replicas, so c's next call
            # is refused by whichever it reaches first: the trainer, or the replica it generates on.
            await trainer.DeleteAdapter(trainer_pb2.AdapterRequest(name=recs[c].adapter))
            await manager.command(a, "pause")
            await _until(lambda: _state(manager, c, "FAILED"))
            await _until(lambda: _state(manager, a, "PAUSED"))
            paused_at = (await manager.get(a)).step
            failed = (await manager.get(c)).message
            assert (f"no adapter {recs[c].adapter!r} on this trainer" in failed
                    or f"sampling.adapter: {recs[c].adapter!r} is not loaded on this replica" in failed), failed
            # b runs to its end while a is paused and c has failed.
            await _until(lambda: _state(manager, b, "COMPLETED"))
            done_b = await manager.get(b)
            # A run frees what it holds before its end state is written: a client that reads COMPLETED or FAILED
            # and starts another run at once finds the schedulers, the trainer's and the replicas' slots free.
            assert await _left(manager, b, c)
            assert await _named(manager.contexts[a].trainer, "")
            assert done_b.step == 3 and done_b.checkpoint_step == 3 and done_b.last_metrics["actor/lr"] == 3e-4
            assert (await manager.get(a)).step == paused_at
            await manager.command(a, "resume")
            await _until(lambda: _steps_past(manager, a, paused_at))
            await manager.command(a, "stop")
            await _until(lambda: _state(manager, a, "STOPPED"))
            return done_b
        finally:
            await manager.close()
            await mesh.stop()

    done_b = asyncio.run(main())
    # b's checkpoint holds its adapter alone (weights, optimizer, step).
    assert (tmp_path / "runs" / done_b.run_id / "checkpoints" / "step_3" / "adapter_state.pt").is_file()


def test_a_named_adapter_run_resumes_from_its_own_checkpoint_after_a_coordinator_restart(tmp_path):
    async def main():
        mesh = await start_local_mesh(lora_recipe(tmp_path / "runs"), num_rollout=1, num_reference=0)
        store = MemoryStore()
        manager = RunManager(store)
        try:
            a = await manager.start_run(_run(mesh.config, "a", 40, 1e-3))
            d = await manager.start_run(_run(mesh.config, "d", 5, 3e-4, checkpoint_every=2))
            await _until(lambda: _steps_past(manager, d, 2))
            for task in list(manager.tasks.values()):       # the coordinator goes away mid-run
                task.cancel()
            await asyncio.gather(*manager.tasks.values(), return_exceptions=True)
            stopped_at = (await store.get(d)).step
            again = RunManager(store)
            assert set(await again.resume_unfinished()) == {a, d}
            resumed = await again.get(d)
            assert resumed.adapter == (await store.get(d)).adapter != ""
            assert resumed.step == 2 and resumed.checkpoint_step == 2
            await _until(lambda: _state(again, d, "COMPLETED"))
            steps = [m["step"] for m in await again.metrics(d) if "reward_mean" in m]
            await again.command(a, "stop")
            await _until(lambda: _state(again, a, "STOPPED"))
            await again.close()
            return stopped_at, resumed, steps
        finally:
            await mesh.stop()

    stopped_at, resumed, steps = asyncio.run(main())
    assert stopped_at >= 3
    assert f"steps 3..{stopped_at} replayed from checkpoint" in resumed.message
    assert steps == [1, 2, 3, 4, 5]


async def _state(manager: RunManager, run_id: str, state: str) -> bool:
    return (await manager.get(run_id)).state == state


async def _left(manager: RunManager, *run_ids: str) -> bool:
    return not any(r in s.shares for r in run_ids for s in manager.schedulers.values())


async def _named(trainer, held: str) -> bool:
    return (await remote.info(trainer)).details["named_adapters"] == held


async def _steps_past(manager: RunManager, run_id: str, step: int) -> bool:
    return (await manager.get(run_id)).step > step


def test_a_second_run_beside_a_full_parameter_run_is_refused_by_name(tmp_path):
    recipe = yaml.safe_load((REPO / "examples/arith/grpo.yaml").read_text())
    recipe["rollout"].update(replicas=1, n=2, max_tokens=4)
    recipe["data"].update(rollout_batch_size=2, heldout_size=2)
    recipe["run"].update(num_steps=40, eval_every=0, run_dir=str(tmp_path / "runs"))
    recipe["actor"].pop("lora", None)
    recipe["algorithm"].update(use_kl_loss=False, kl_loss_coef=0.0)      # no reference replica needed

    async def main():
        mesh = await start_local_mesh(recipe, num_rollout=1, num_reference=0)
        manager = RunManager(MemoryStore())
        try:
            first = await manager.start_run(_run(mesh.config, "full", 40, 1e-5))
            with pytest.raises(FailedPrecondition, match=r"training full-parameter run 'full-[^']*'; a "
                                                         r"full-parameter run holds its trainer alone"):
                await manager.start_run(_run(mesh.config, "second", 2, 1e-5))
            await manager.command(first, "stop")
            await _until(lambda: _state(manager, first, "STOPPED"))
            # The stopped run let go of its trainer before it read STOPPED: the next run starts at once.
            second = await manager.start_run(_run(mesh.config, "second", 1, 1e-5))
            await _until(lambda: _state(manager, second, "COMPLETED"))
        finally:
            await manager.close()
            await mesh.stop()

    asyncio.run(main())


def test_runs_that_start_as_others_end_find_adapter_slots_on_a_replica_of_two(tmp_path):
    """A replica serving 2 adapters: a (the trainer's own adapter) and b (named) run at once; a ends, c starts beside
    b and gets a slot (a's left the replica with it); once both end, d runs alone on the trainer's adapter again,
    pushed anew, and learns from the base like any run."""
    recipe = lora_recipe(tmp_path / "runs")
    recipe["rollout"]["max_loras"] = 2

    async def main():
        mesh = await start_local_mesh(recipe, num_rollout=1, num_reference=0)
        manager = RunManager(MemoryStore())
        try:
            a = await manager.start_run(_run(mesh.config, "a", 2, 1e-3))
            b = await manager.start_run(_run(mesh.config, "b", 40, 1e-3))
            await _until(lambda: _state(manager, a, "COMPLETED"))
            c = await manager.start_run(_run(mesh.config, "c", 2, 1e-3))
            await _until(lambda: _state(manager, c, "COMPLETED"))
            await manager.command(b, "stop")
            await _until(lambda: _state(manager, b, "STOPPED"))
            d = await manager.start_run(_run(mesh.config, "d", 2, 1e-3))
            await _until(lambda: _state(manager, d, "COMPLETED"))
            return [await manager.get(r) for r in (a, b, c, d)]
        finally:
            await manager.close()
            await mesh.stop()

    a, b, c, d = asyncio.run(main())
    assert a.adapter == "" and b.adapter and c.adapter and d.adapter == ""
    assert c.step == 2 and d.step == 2, (c.message, d.message)
