"""A pool whose only replica is down waits `rejoin_wait_s` for it to come back (a replica `meshrl up` restarts)
instead of failing the call; with 0 it fails at once, as before."""

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.errors import Unavailable
from services.common.rpc.pools import ReplicaPool


async def _replica():
    """A real gRPC server whose health says NOT_SERVING (a replica that is restarting)."""
    server = grpc.aio.server()
    status = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(status, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await status.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    return server, status, f"127.0.0.1:{port}"


def _pool(address: str, rejoin_wait_s: float) -> ReplicaPool:
    return ReplicaPool("reward", health_pb2_grpc.HealthStub, servers=[address], rejoin_wait_s=rejoin_wait_s)


async def _call(pool: ReplicaPool):
    return await pool.call(lambda stub: stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0))


def test_a_call_waits_for_the_only_replica_to_come_back():
    async def main():
        server, status, address = await _replica()
        pool = _pool(address, rejoin_wait_s=30.0)
        try:
            assert await pool.refresh() == []          # down: the pool sees no healthy replica
            call = asyncio.create_task(_call(pool))
            await asyncio.sleep(0)
            assert not call.done()
            await status.set("", health_pb2.HealthCheckResponse.SERVING)   # back
            return (await call).status
        finally:
            await pool.close()
            await server.stop(0)

    assert asyncio.run(main()) == health_pb2.HealthCheckResponse.SERVING


def test_without_a_rejoin_wait_a_call_with_no_healthy_replica_fails_at_once():
    async def main():
        server, _, address = await _replica()
        pool = _pool(address, rejoin_wait_s=0.0)
        try:
            await pool.refresh()
            await _call(pool)
        finally:
            await pool.close()
            await server.stop(0)

    with pytest.raises(Unavailable, match="reward pool: no healthy replica"):
        asyncio.run(main())
