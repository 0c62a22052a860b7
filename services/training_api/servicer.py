"""gRPC servicer of the training API (protos/meshrl/v1/training.proto): converts and delegates to TrainingEngine."""

from __future__ import annotations

import asyncio

from meshrl.v1 import training_pb2, training_pb2_grpc
from services.common import convert as common_convert
from services.common.rpc.server import MeshServer, create_server
from services.training_api import convert
from services.training_api.backends import Mesh
from services.training_api.config import TrainingSettings
from services.training_api.engine import TrainingEngine


class TrainingServicer(training_pb2_grpc.TrainingServicer):
    def __init__(self, engine: TrainingEngine):
        self.engine = engine

    async def CreateTrainingClient(self, request, context):
        return convert.client_to_pb(await self.engine.create(request.base_model, request.rank))

    async def CloseTrainingClient(self, request, context):
        return convert.client_to_pb(await self.engine.close_client(request.client_id))

    async def ForwardBackward(self, request, context):
        return await self.engine.forward_backward(request.client_id, request.request)

    async def OptimStep(self, request, context):
        return await self.engine.optim_step(request.client_id, request.adam_params)

    async def Sample(self, request, context):
        if request.num_samples < 1:
            raise ValueError(f"num_samples: must be >= 1, got {request.num_samples}")
        sampling = training_pb2.SampleRequest().sampling_params
        sampling.CopyFrom(request.sampling_params)
        sampling.n = request.num_samples
        results, version = await self.engine.sample(request.client_id, [list(p.tokens) for p in request.prompts],
                                                    sampling)
        return convert.samples_to_pb(results, version)

    async def SaveState(self, request, context):
        return convert.state_to_pb(await self.engine.save_state(request.client_id, request.path))

    async def LoadState(self, request, context):
        return convert.state_to_pb(await self.engine.load_state(request.client_id, request.path))

    async def GetTokenizer(self, request, context):
        tok = await asyncio.to_thread(self.engine.tokenizer, request.client_id)
        files = await asyncio.to_thread(self.engine.tokenizer_files, request.client_id)

        def special(token_id) -> int:
            return -1 if token_id is None else int(token_id)

        return training_pb2.TokenizerResponse(files=files, eos_token_id=special(tok.eos_token_id),
                                              bos_token_id=special(tok.bos_token_id),
                                              pad_token_id=special(tok.pad_token_id), vocab_size=len(tok))

    async def Encode(self, request, context):
        tok = await asyncio.to_thread(self.engine.tokenizer, request.client_id)
        ids = [tok.encode(t, add_special_tokens=request.add_special_tokens) for t in request.texts]
        return training_pb2.EncodeResponse(results=[training_pb2.TokenIds(ids=i) for i in ids])

    async def Decode(self, request, context):
        tok = await asyncio.to_thread(self.engine.tokenizer, request.client_id)
        skip = request.skip_special_tokens
        for i, ids in enumerate(request.ids):
            bad = [t for t in ids.ids if not 0 <= t < len(tok)]
            if bad:
                raise ValueError(f"ids[{i}]: token id {bad[0]} outside the vocabulary [0, {len(tok)})")
        texts = [tok.decode(list(i.ids), skip_special_tokens=skip) for i in request.ids]
        return training_pb2.DecodeResponse(texts=texts)

    async def GetInfo(self, request, context):
        return common_convert.info_to_pb("training", self.engine.model_path, self.engine.synced or 0,
                                         self.engine.info())


SERVICE_NAME = training_pb2.DESCRIPTOR.services_by_name["Training"].full_name


async def start(settings: TrainingSettings, address: str | None = None) -> tuple[MeshServer, int, TrainingEngine]:
    """Serves the training API for the trainer and rollout replicas the settings name (a mesh without rollout
    replicas serves every primitive but Sample)."""
    if not settings.trainer.address:
        raise ValueError("trainer.address: the training API drives the mesh's trainer; name its address "
                         "(`meshrl mesh RECIPE` fills it in)")
    token = settings.server.auth_token.get_secret_value() if settings.server.auth_token else None
    mesh = Mesh(settings.trainer.address, settings.rollout.servers, token=token,
                timeout=settings.training_api.call_timeout_s, rollout_dns=settings.rollout.dns)
    engine = TrainingEngine(settings, mesh)
    try:
        server, port = await create_server([(training_pb2_grpc.add_TrainingServicer_to_server,
                                             TrainingServicer(engine))], [SERVICE_NAME], address=address,
                                           config=settings.server)
    except BaseException:
        await mesh.close()
        raise
    return server, port, engine
