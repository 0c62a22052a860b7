"""Run commands on a run that is paused with no task driving it (its trainer went away)."""

import asyncio

import pytest

from coordinator.runapi.runs import RunManager
from coordinator.runapi.store import MemoryStore, RunRecord
from services.common.errors import FailedPrecondition


def test_stopping_a_run_paused_for_a_lost_trainer_stops_it_at_once():
    async def main():
        manager = RunManager(MemoryStore())
        await manager.store.put(RunRecord(run_id="r", config="", state="PAUSED", step=3,
                                          message="trainer 127.0.0.1:1 unavailable during TrainActor"))
        assert (await manager.command("r", "pause")).state == "PAUSED"
        assert (await manager.command("r", "stop")).state == "STOPPED"
        assert (await manager.get("r")).step == 3
        with pytest.raises(FailedPrecondition):
            await manager.command("r", "resume")

    asyncio.run(main())


def test_resuming_a_run_paused_for_a_lost_trainer_reconnects_and_reports_what_fails():
    async def main():
        manager = RunManager(MemoryStore())
        # A config that cannot connect: the reason comes back, and the run stays paused.
        await manager.store.put(RunRecord(run_id="r", config="trainer: {address: ''}\n", state="PAUSED", step=3))
        with pytest.raises(ValueError, match="trainer.address"):
            await manager.command("r", "resume")
        assert (await manager.get("r")).state == "PAUSED" and "r" not in manager.tasks

    asyncio.run(main())


def test_a_pause_or_stop_reads_pending_until_the_run_state_shows_it_landed():
    async def landed(manager, run_id: str, state: str) -> str:
        record = await manager.get(run_id)
        record.state = state                            # what the run's loop writes once the step in flight ends
        await manager.store.put(record)
        return (await manager.get(run_id)).pending_command

    async def main():
        manager = RunManager(MemoryStore())
        for run_id in ("p", "s"):
            await manager.store.put(RunRecord(run_id=run_id, config="", state="RUNNING", step=2))
        return [(await manager.command("p", "pause")).pending_command, await landed(manager, "p", "PAUSED"),
                (await manager.command("s", "stop")).pending_command, await landed(manager, "s", "STOPPED")]

    assert asyncio.run(main()) == ["pause", "", "stop", ""]
