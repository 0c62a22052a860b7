"""gRPC servicer of the env service: converts and delegates to EnvEngine."""

from __future__ import annotations

import json

from meshrl.v1 import env_pb2, env_pb2_grpc
from services.common.config import settings_json
from services.common.convert import info_to_pb
from services.common.rpc.server import MeshServer, create_server
from services.env import convert
from services.env.config import EnvSettings
from services.env.engine import EnvEngine


class EnvServicer(env_pb2_grpc.EnvServicer):
    def __init__(self, engine: EnvEngine, settings: EnvSettings):
        self.engine = engine
        self.settings = settings

    async def CallTools(self, request, context):
        calls = convert.calls_from_pb(request)
        return convert.results_to_pb(await self.engine.call_tools(calls, request.episode_id))

    async def ListTools(self, request, context):
        return env_pb2.ListToolsResponse(tools_json=[json.dumps(t) for t in self.engine.list_tools()])

    async def Reset(self, request, context):
        kwargs = convert.json_object(request.kwargs_json, "kwargs_json")
        return env_pb2.ResetResponse(observation=await self.engine.reset(request.episode_id, request.environment,
                                                                         kwargs))

    async def Step(self, request, context):
        return convert.step_to_pb(await self.engine.step(request.episode_id, request.action))

    async def EndEpisode(self, request, context):
        return env_pb2.EndEpisodeResponse(existed=await self.engine.end(request.episode_id))

    async def GetInfo(self, request, context):
        return info_to_pb("env", "", 0, {**self.engine.info(), "settings": settings_json(self.settings)})


SERVICE_NAME = env_pb2.DESCRIPTOR.services_by_name["Env"].full_name


async def start(settings: EnvSettings, address: str | None = None) -> tuple[MeshServer, int, EnvEngine]:
    """Builds the engine (user tools and environments are loaded and checked here) and starts serving it."""
    engine = EnvEngine(settings)
    try:
        mesh, port = await create_server([(env_pb2_grpc.add_EnvServicer_to_server, EnvServicer(engine, settings))],
                                         [SERVICE_NAME], address=address, config=settings.server)
    except BaseException:
        await engine.close()
        raise
    return mesh, port, engine
