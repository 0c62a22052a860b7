"""Requests of the run API that name a run: an empty run_id is refused by its field, the same on every RPC; a stop
asked for during a step says it is pending until it lands."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
import yaml

from coordinator.cli.manage import command_line, status_message
from coordinator.client import Client
from coordinator.runapi.service import CoordinatorSettings, start as start_coordinator
from meshrl.v1 import coordinator_pb2 as pb, coordinator_pb2_grpc
from services.common.config import load_config
from services.local import start_local_mesh

REQUIRED = "run_id: required (the id StartRun answered; ListRuns lists every run)"


def test_every_rpc_that_names_a_run_refuses_an_empty_run_id_by_its_field():
    calls = {name: pb.RunRequest() for name in ("GetRun", "PauseRun", "ResumeRun", "StopRun", "SaveCheckpoint")}

    async def main():
        server, port, engine = await start_coordinator(load_config(CoordinatorSettings, data={}), "127.0.0.1:0")
        answers = {}
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = coordinator_pb2_grpc.CoordinatorStub(channel)
                for name, request in calls.items():
                    try:
                        await getattr(stub, name)(request, timeout=10)
                    except grpc.aio.AioRpcError as e:
                        answers[name] = (e.code(), e.details())
                try:
                    [m async for m in stub.StreamMetrics(pb.StreamMetricsRequest(), timeout=10)]
                except grpc.aio.AioRpcError as e:
                    answers["StreamMetrics"] = (e.code(), e.details())
                # ListServices' run_id is optional: empty lists the coordinator's own pools (none here).
                listed = await stub.ListServices(pb.ListServicesRequest(), timeout=10)
        finally:
            await engine.close()
            await server.stop(0)
        return answers, listed

    answers, listed = asyncio.run(main())
    assert answers == {name: (grpc.StatusCode.INVALID_ARGUMENT, REQUIRED) for name in [*calls, "StreamMetrics"]}
    assert list(listed.replicas) == []


def _wait_for(check, what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"waited {timeout:g}s for {what}"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_stop_during_a_step_answers_running_with_the_stop_pending_until_it_lands(arith_model_path, tmp_path,
                                                                                  monkeypatch):
    # Step 1's rewards are held at a gate (tests/integration/gated_reward.py; no held-out set, so they are the run's
    # first reward calls): the stop arrives while that step is in flight, whatever the machine's load.
    gate = tmp_path / "gate"
    gate.mkdir()
    (gate / "hold").touch()
    monkeypatch.setenv("MESHRL_TEST_GATE", str(gate))
    recipe = yaml.safe_load(Path("examples/arith/grpo.yaml").read_text())
    del recipe["data"]["heldout_files"]
    recipe["model"]["path"] = arith_model_path
    recipe["reward"] = {"custom_function": {"path": str(Path(__file__).with_name("gated_reward.py"))},
                        "function_timeout_s": 600}
    recipe["run"] = {**recipe.get("run", {}), "num_steps": 5, "eval_every": 0, "run_dir": str(tmp_path)}

    async def main():
        mesh = await start_local_mesh(recipe, num_rollout=1)
        server, port, engine = await start_coordinator(load_config(CoordinatorSettings, data={}), "127.0.0.1:0")
        client = Client(f"127.0.0.1:{port}")
        try:
            run_id = await asyncio.to_thread(client.start_run, yaml.safe_dump(mesh.config))
            await asyncio.to_thread(_wait_for, (gate / "held").exists, "step 1's rewards held at the gate")
            stopping = await asyncio.to_thread(client.stop_run, run_id)
            shown = await asyncio.to_thread(client.get_run, run_id)
            (gate / "go").touch()
            return stopping, shown, await asyncio.to_thread(client.wait, run_id)
        finally:
            (gate / "go").touch()
            client.close()
            await engine.close()
            await server.stop(0)
            await mesh.stop()

    stopping, shown, final = asyncio.run(main())
    for status in (stopping, shown):
        assert (status.state, status.pending_command, status.step) == ("RUNNING", "stop", 0)
    assert command_line(stopping, "stop") == f"run {stopping.run_id} stops after its current step (steps done: 0/5)"
    assert status_message(shown) == "stops after its current step"          # `meshrl status`'s message cell
    assert (final.state, final.pending_command, final.step) == ("STOPPED", "", 1)
