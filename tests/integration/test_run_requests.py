"""Requests of the run API that name a run: an empty run_id is refused by its field, the same on every RPC."""

from __future__ import annotations

import asyncio

import grpc

from coordinator.runapi.service import CoordinatorSettings, start as start_coordinator
from meshrl.v1 import coordinator_pb2 as pb, coordinator_pb2_grpc
from services.common.config import load_config

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
