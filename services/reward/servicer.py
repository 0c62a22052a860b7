"""gRPC servicer of the reward service: converts and delegates to RewardEngine."""

from __future__ import annotations

from meshrl.v1 import reward_pb2, reward_pb2_grpc
from services.common.convert import info_to_pb
from services.common.config import settings_json
from services.common.rpc.server import MeshServer, create_server
from services.reward import convert
from services.reward.config import RewardSettings
from services.reward.engine import RewardEngine


class RewardServicer(reward_pb2_grpc.RewardServicer):
    def __init__(self, engine: RewardEngine, settings: RewardSettings):
        self.engine = engine
        self.settings = settings

    async def Score(self, request, context):
        items = convert.items_from_pb(request)
        return convert.results_to_pb(items, await self.engine.score(items, convert.components_from_pb(request)))

    async def GetInfo(self, request, context):
        return info_to_pb("reward", self.engine.model, 0, {**self.engine.info(),
                                                           "settings": settings_json(self.settings)})


SERVICE_NAME = reward_pb2.DESCRIPTOR.services_by_name["Reward"].full_name


async def start(settings: RewardSettings, address: str | None = None) -> tuple[MeshServer, int, RewardEngine]:
    """Builds the engine (user functions are loaded and checked here) and starts serving it."""
    engine = RewardEngine(settings)
    try:
        servicer = RewardServicer(engine, settings)
        mesh, port = await create_server([(reward_pb2_grpc.add_RewardServicer_to_server, servicer)], [SERVICE_NAME],
                                         address=address, config=settings.server)
    except BaseException:
        await engine.close()
        raise
    return mesh, port, engine
