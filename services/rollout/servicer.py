"""gRPC servicer of the rollout service: converts and delegates to a RolloutEngine."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator

from meshrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.common import convert as common_convert
from services.common.server import MeshServer, create_server
from services.rollout import convert
from services.rollout.engine import RolloutEngine, RolloutSettings, build_engine

log = logging.getLogger("meshrl.rollout")


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, engine: RolloutEngine, settings: RolloutSettings):
        self.engine = engine
        self.defaults = settings.rollout

    async def Generate(self, request, context):
        results = await self.engine.generate(convert.request_from_pb(request, self.defaults))
        return convert.results_to_pb(results)

    async def ComputeLogProbs(self, request, context):
        batch = common_convert.sequences_from_pb(request)
        logprobs, version = await self.engine.logprobs(batch.prompts, batch.responses, batch.temperature)
        return common_convert.logprobs_to_pb(batch.ids, logprobs, weight_version=version)

    async def GetInfo(self, request, context):
        return common_convert.info_to_pb("rollout", self.engine.model_path, self.engine.weight_version,
                                         self.engine.info())

    async def UpdateWeights(self, request_iterator, context):
        first = None
        async for first in request_iterator:
            break
        if first is None or not first.HasField("manifest"):
            raise ValueError("UpdateWeights: the first message must carry the manifest")
        manifest = convert.manifest_from_pb(first.manifest)
        done = await self.engine.update_weights(manifest, _buckets(request_iterator))
        return common_pb2.UpdateWeightsResponse(**done)


async def _buckets(request_iterator) -> AsyncIterator[tuple[bytes, int]]:
    i = 0
    async for msg in request_iterator:
        i += 1
        if msg.HasField("manifest"):
            raise ValueError(f"UpdateWeights: message {i} carries a second manifest")
        yield msg.data, msg.crc32


SERVICE_NAME = rollout_pb2.DESCRIPTOR.services_by_name["Rollout"].full_name


@dataclass
class RolloutReplica:
    """What start() brings up besides the gRPC server: the engine and, when configured, the HTTP API."""

    engine: RolloutEngine
    http_port: int | None = None
    _http_runner: Any = None

    async def close(self) -> None:
        if self._http_runner is not None:
            await self._http_runner.cleanup()
            self._http_runner = None
        await self.engine.close()


async def start(settings: RolloutSettings, address: str | None = None, *,
                engine: RolloutEngine | None = None) -> tuple[MeshServer, int, RolloutReplica]:
    """Starts a replica: the engine `rollout.engine` names behind a gRPC server, plus the OpenAI-compatible
    HTTP API on `rollout.http_port` when that is set. `await replica.close()` stops the HTTP API."""
    engine = engine or build_engine(settings)
    replica = RolloutReplica(engine)
    r = settings.rollout
    if r.http_port is not None:
        try:
            from services.rollout.http_api import start_http
        except ImportError as e:
            raise ValueError(f"rollout.http_port: the HTTP API needs aiohttp (pip install aiohttp): {e}") from None
        token = settings.server.auth_token.get_secret_value() if settings.server.auth_token else None
        replica._http_runner, replica.http_port = await start_http(
            engine, host=settings.server.host, port=r.http_port, model_name=r.served_model_name or engine.model_path,
            defaults=r, auth_token=token)
    try:
        mesh, port = await create_server([(rollout_pb2_grpc.add_RolloutServicer_to_server,
                                           RolloutServicer(engine, settings))], [SERVICE_NAME], address=address,
                                         config=settings.server)
    except BaseException:
        await replica.close()
        raise
    return mesh, port, replica
