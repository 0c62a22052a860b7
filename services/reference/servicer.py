"""gRPC servicer of the reference service: converts and delegates to ReferenceEngine."""

from __future__ import annotations

import asyncio

from meshrl.v1 import reference_pb2, reference_pb2_grpc
from services.common import convert
from services.common.config import settings_json
from services.common.rpc.server import MeshServer, create_server
from services.reference.config import ReferenceSettings
from services.reference.engine import ReferenceEngine
from services.reference.types import LogProbEngine


class ReferenceServicer(reference_pb2_grpc.ReferenceServicer):
    def __init__(self, engine: LogProbEngine, settings: ReferenceSettings):
        self.engine = engine
        self.settings = settings

    async def ComputeLogProbs(self, request, context):
        batch = convert.sequences_from_pb(request)
        logprobs = await self.engine.logprobs(batch.prompts, batch.responses, batch.temperature,
                                              as_arrays=request.packed or batch.columnar)
        return convert.logprobs_to_pb(batch.ids, logprobs, weight_version=0, packed=request.packed,
                                      columnar=batch.columnar)

    async def GetInfo(self, request, context):
        return convert.info_to_pb("reference", self.engine.model_path, 0,
                                  {**self.engine.info(), "settings": settings_json(self.settings)})


SERVICE_NAME = reference_pb2.DESCRIPTOR.services_by_name["Reference"].full_name


async def start(settings: ReferenceSettings, address: str | None = None) -> tuple[MeshServer, int, ReferenceEngine]:
    engine = ReferenceEngine(settings)
    await asyncio.to_thread(engine.warm_up)      # before the server exists: SERVING means warm
    mesh, port = await create_server([(reference_pb2_grpc.add_ReferenceServicer_to_server,
                                       ReferenceServicer(engine, settings))], [SERVICE_NAME], address=address,
                                     config=settings.server)
    return mesh, port, engine
