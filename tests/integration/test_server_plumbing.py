"""The shared server factory: error mapping, bearer-token auth, health, reflection, graceful stop."""

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from meshrl.v1 import common_pb2, reward_pb2, reward_pb2_grpc
from services.common.rpc.channel import create_channel
from services.common.config import ServerConfig
from services.common.errors import FailedPrecondition
from services.common.rpc.server import create_server

SERVICE = reward_pb2.DESCRIPTOR.services_by_name["Reward"].full_name


class FaultyReward(reward_pb2_grpc.RewardServicer):
    """Raises what engines raise, so the interceptor's mapping is what the client sees."""

    def __init__(self):
        self.release = asyncio.Event()
        self.entered = asyncio.Event()   # a "slow" call has reached the handler

    async def Score(self, request, context):
        if not request.items:
            raise ValueError("items: empty batch")
        if request.items[0].id == "precondition":
            raise FailedPrecondition("model not loaded")
        if request.items[0].id == "echo":  # a large answer: as many characters as the request's response
            text = request.items[0].response
            return reward_pb2.ScoreResponse(results=[reward_pb2.ScoreResult(id="echo", score=len(text), error=text)])
        if request.items[0].id == "slow":
            self.entered.set()
            await self.release.wait()
            return reward_pb2.ScoreResponse(results=[reward_pb2.ScoreResult(id="slow", score=1.0)])
        raise RuntimeError("boom")

    async def GetInfo(self, request, context):
        return common_pb2.ServiceInfo(role="reward")


async def _serve(token=None):
    servicer = FaultyReward()
    mesh, port = await create_server([(reward_pb2_grpc.add_RewardServicer_to_server, servicer)], [SERVICE],
                                     address="127.0.0.1:0", config=ServerConfig(auth_token=token))
    return mesh, port, servicer


async def _code(coro):
    try:
        await coro
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def test_value_error_in_an_engine_reaches_the_client_as_invalid_argument_with_its_message():
    async def main():
        mesh, port, _ = await _serve()
        stub = reward_pb2_grpc.RewardStub(create_channel(f"127.0.0.1:{port}"))
        code, details = await _code(stub.Score(reward_pb2.ScoreRequest()))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details == "items: empty batch"
        code, details = await _code(stub.Score(reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(id="x")])))
        assert code == grpc.StatusCode.INTERNAL and "RuntimeError: boom" in details
        code, details = await _code(stub.Score(reward_pb2.ScoreRequest(
            items=[reward_pb2.ScoreItem(id="precondition")])))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and details == "model not loaded"
        # The server keeps serving after errors.
        assert (await stub.GetInfo(common_pb2.GetInfoRequest())).role == "reward"
        await mesh.stop(0)

    asyncio.run(main())


def test_auth_rejects_missing_and_wrong_tokens_but_health_needs_none():
    async def main():
        mesh, port, _ = await _serve(token="s3cret")
        addr = f"127.0.0.1:{port}"
        for token in (None, "wrong"):
            stub = reward_pb2_grpc.RewardStub(create_channel(addr, token=token))
            code, details = await _code(stub.GetInfo(common_pb2.GetInfoRequest()))
            assert code == grpc.StatusCode.UNAUTHENTICATED, token
            assert "s3cret" not in details
        good = reward_pb2_grpc.RewardStub(create_channel(addr, token="s3cret"))
        assert (await good.GetInfo(common_pb2.GetInfoRequest())).role == "reward"
        health = health_pb2_grpc.HealthStub(create_channel(addr))
        resp = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        await mesh.stop(0)

    asyncio.run(main())


def test_reflection_lists_the_service():
    async def main():
        mesh, port, _ = await _serve()
        stub = reflection_pb2_grpc.ServerReflectionStub(create_channel(f"127.0.0.1:{port}"))

        async def requests():
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        names = []
        async for resp in stub.ServerReflectionInfo(requests()):
            names = [s.name for s in resp.list_services_response.service]
        assert SERVICE in names and "grpc.health.v1.Health" in names
        await mesh.stop(0)

    asyncio.run(main())


def test_stop_flips_health_to_not_serving_and_lets_in_flight_calls_finish():
    async def main():
        mesh, port, servicer = await _serve()
        addr = f"127.0.0.1:{port}"
        stub = reward_pb2_grpc.RewardStub(create_channel(addr))
        in_flight = asyncio.ensure_future(stub.Score(reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(id="slow")])))
        await asyncio.wait_for(servicer.entered.wait(), 30)
        stopping = asyncio.create_task(mesh.stop(grace=5.0))
        for _ in range(1000):  # until stop() has flipped health; the call is still held by the handler
            status = await mesh.health.Check(health_pb2.HealthCheckRequest(service=""), None)
            if status.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            await asyncio.sleep(0.01)
        assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert not in_flight.done() and not stopping.done()
        servicer.release.set()
        result = await in_flight
        assert result.results[0].score == 1.0
        await stopping

    asyncio.run(main())


def test_oversized_message_limit_is_raised_above_grpc_default():
    # 6 MiB each way through a real server: over gRPC's 4 MiB default, under the mesh's limit.
    big = "x" * (6 * 1024 * 1024)
    request = reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(id="echo", response=big)])

    async def main():
        mesh, port, _ = await _serve()
        try:
            async with create_channel(f"127.0.0.1:{port}") as channel:
                reply = await reward_pb2_grpc.RewardStub(channel).Score(request)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as plain:  # gRPC's default limits
                code, _ = await _code(reward_pb2_grpc.RewardStub(plain).Score(request))
        finally:
            await mesh.stop(0)
        return reply.results[0], code

    result, default_code = asyncio.run(main())
    assert result.score == len(big) and len(result.error) == len(big)
    assert default_code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_new_channel_reaches_a_service_that_just_came_up_on_a_port_that_failed_before():
    # gRPC shares connections between channels by default, so a new channel inherited another's failed,
    # backing-off connection and failed fast (a resumed run could not reach its restarted trainer).
    import socket

    async def main():
        # A socket bound to the port but not listening holds it (connections are refused) for the whole test; with
        # SO_REUSEADDR on both, the server binds it too once it starts (Linux lets a listener join a bound,
        # non-listening socket): nothing else can take the port in between.
        with socket.socket() as held:
            held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            held.bind(("127.0.0.1", 0))
            port = held.getsockname()[1]
            return await reach(port)

    async def reach(port: int):
        async with create_channel(f"127.0.0.1:{port}", max_attempts=1) as early:
            for _ in range(3):
                with pytest.raises(grpc.aio.AioRpcError):
                    await health_pb2_grpc.HealthStub(early).Check(health_pb2.HealthCheckRequest(), timeout=2)
            mesh, _ = await create_server([(reward_pb2_grpc.add_RewardServicer_to_server, FaultyReward())], [SERVICE],
                                          address=f"127.0.0.1:{port}", config=ServerConfig())
            try:
                async with create_channel(f"127.0.0.1:{port}", max_attempts=1) as fresh:
                    reply = await health_pb2_grpc.HealthStub(fresh).Check(health_pb2.HealthCheckRequest(), timeout=2)
            finally:
                await mesh.stop(0)
        return reply.status

    assert asyncio.run(main()) == health_pb2.HealthCheckResponse.SERVING
