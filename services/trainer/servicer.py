"""gRPC servicer of the trainer (rank 0): converts and delegates to TrainerEngine and a WeightSender."""

from __future__ import annotations

import asyncio
import time

from meshrl.v1 import reference_pb2, reference_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from services.common import convert as common_convert
from services.common.config import settings_json
from services.common.errors import FailedPrecondition
from services.common.placement import Placement
from services.common.rpc.server import MeshServer, create_server
from services.common.tensors.weight_transport import placement_of
from services.trainer import convert
from services.trainer.config import TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.weights.adapter import AdapterSync
from services.trainer.weights.choice import AutoSender, available_senders, build_sender, check_transport
from services.trainer.weights.senders import WeightSender


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, engine: TrainerEngine, sender: WeightSender):
        self.engine = engine
        self.sender = sender
        # actor.lora: pushes carry the adapter alone to replicas that serve adapters (weights/adapter.py).
        self.adapters = AdapterSync(engine, sender, token=getattr(sender, "token", None),
                                    timeout=getattr(sender, "timeout", None)) if engine.rank.cfg.lora else None

    async def ComputeLogProbs(self, request, context):
        batch = common_convert.sequences_from_pb(request)
        logprobs = await asyncio.to_thread(self.engine.compute_logprobs, batch.prompts, batch.responses,
                                           batch.temperature, request.adapter)
        return common_convert.logprobs_to_pb(batch.ids, logprobs, self.engine.adapter_version(request.adapter),
                                             packed=request.packed, columnar=batch.columnar)

    async def ComputeValues(self, request, context):
        ids, prompts, responses = convert.values_request_from_pb(request)
        values = await asyncio.to_thread(self.engine.compute_values, prompts, responses)
        return convert.values_to_pb(ids, values)

    async def TrainActor(self, request, context):
        samples, loss = convert.train_actor_from_pb(request)
        metrics, repeated = await asyncio.to_thread(self.engine.train_actor_step, samples, loss,
                                                    convert.run_step_from_pb(request), request.adapter)
        return convert.train_response_to_pb(self.engine.adapter_progress(request.adapter)[0], metrics, repeated)

    async def TrainCritic(self, request, context):
        samples, loss = convert.train_critic_from_pb(request)
        metrics, repeated = await asyncio.to_thread(self.engine.train_critic_step, samples, loss,
                                                    convert.run_step_from_pb(request))
        return convert.train_response_to_pb(self.engine.rank.critic.step, metrics, repeated)

    async def TrainDPO(self, request, context):
        pairs, loss = convert.train_dpo_from_pb(request)
        metrics, repeated = await asyncio.to_thread(self.engine.train_dpo_step, pairs, loss,
                                                    convert.run_step_from_pb(request))
        return convert.train_response_to_pb(self.engine.rank.actor.step, metrics, repeated)

    async def PushWeights(self, request, context):
        targets = list(request.targets)
        if not targets:
            raise ValueError("targets: no rollout replicas given")
        if len(set(targets)) != len(targets):
            raise ValueError("targets: duplicate addresses")
        if request.bucket_bytes < 0:
            raise ValueError(f"bucket_bytes: must be >= 0, got {request.bucket_bytes}")
        t0 = time.perf_counter()
        rank = self.engine.rank
        if isinstance(self.sender, AutoSender):
            default = 0                             # each transport's own
        else:
            default = rank.cfg.weight_bucket_bytes if self.sender.transport == "grpc" else \
                rank.settings.weight_sync.device_bucket_bytes
        if request.adapter and self.adapters is None:
            raise FailedPrecondition(f"adapter: {request.adapter!r}, but this trainer holds no LoRA adapters "
                                     "(no actor.lora)")
        if self.adapters is not None:               # actor.lora: the adapter alone where the replica serves it
            version = self.engine.adapter_version(request.adapter)
            out = await self.adapters.push(targets, request.bucket_bytes or default, request.adapter)
            outcomes, num_bytes = out.outcomes, out.num_bytes
        else:
            if isinstance(self.sender, AutoSender):
                await self.sender.prepare(targets)  # each replica's transport, before the state is fetched
            state, version = await asyncio.to_thread(self.engine.state_for_sync, self.sender.on_device)
            outcomes = await self.sender.push(state, version, targets, bucket_bytes=request.bucket_bytes or default)
            num_bytes = sum(t.numel() * t.element_size() for t in state.values())
        payload, adapter = (out.payload, out.adapter) if self.adapters is not None else ({}, {})
        return trainer_pb2.PushWeightsResponse(
            weight_version=version, num_bytes=num_bytes, seconds=time.perf_counter() - t0,
            results=[trainer_pb2.PushResult(target=o.target, ok=o.ok, error=o.error, seconds=o.seconds,
                                            adapter=adapter.get(o.target, ""),
                                            payload=payload.get(o.target, "full")) for o in outcomes])

    async def SaveCheckpoint(self, request, context):
        return convert.checkpoint_to_pb(await asyncio.to_thread(self.engine.save_checkpoint, request.path,
                                                                request.adapter))

    async def LoadCheckpoint(self, request, context):
        run_step = convert.run_step_from_pb(request)
        return convert.checkpoint_to_pb(await asyncio.to_thread(self.engine.load_checkpoint, request.path, run_step,
                                                                request.adapter))

    async def ExportHF(self, request, context):
        return convert.checkpoint_to_pb(await asyncio.to_thread(self.engine.export_hf, request.path,
                                                                      request.merged))

    async def GetInfo(self, request, context):
        rank = self.engine.rank
        return common_convert.info_to_pb("trainer", rank.model_path, rank.weight_version,
                                         {**self.engine.info(), "weight_transport": self.sender.transport,
                                          "resolved": rank.resolved.json(), **placement_of(rank.device),
                                          "weight_transports": ",".join(available_senders(rank.device)),
                                          "settings": settings_json(rank.settings)})

    async def ForwardBackward(self, request, context):
        data, loss = convert.forward_backward_from_pb(request)
        metrics, logprobs = await asyncio.to_thread(self.engine.forward_backward, data, loss, request.adapter)
        return convert.forward_backward_result_to_pb(metrics, logprobs)

    async def OptimStep(self, request, context):
        metrics = await asyncio.to_thread(self.engine.optim_step, convert.adam_from_pb(request.adam_params),
                                          request.adapter)
        step, version = self.engine.adapter_progress(request.adapter)
        return trainer_pb2.OptimStepResponse(step=step, weight_version=version, metrics=metrics)

    async def CreateAdapter(self, request, context):
        named = await asyncio.to_thread(self.engine.create_adapter, request.name)
        return trainer_pb2.AdapterResponse(name=request.name, rank=self.engine.rank.cfg.lora.rank,
                                           weight_version=named.weight_version, adapters=self.engine.adapter_names())

    async def DeleteAdapter(self, request, context):
        await asyncio.to_thread(self.engine.delete_adapter, request.name)
        # The replicas that serve it free its slot (weights/adapter.py).
        unloaded = await self.adapters.unload(request.name) if self.adapters else {}
        return trainer_pb2.AdapterResponse(name=request.name, adapters=self.engine.adapter_names(), unloaded=unloaded)

    async def ConfigureRun(self, request, context):
        applied = await asyncio.to_thread(self.engine.configure_run, convert.run_optim_from_pb(request))
        return convert.run_optim_to_pb(applied, response=True)


class BaseModelReference(reference_pb2_grpc.ReferenceServicer):
    """Under actor.lora the trainer also answers as a reference replica: the base model with the adapters off,
    so a run names the trainer's address in reference.servers and holds no second copy of the model."""

    def __init__(self, engine: TrainerEngine):
        self.engine = engine

    async def ComputeLogProbs(self, request, context):
        batch = common_convert.sequences_from_pb(request)
        logprobs = await asyncio.to_thread(self.engine.compute_reference_logprobs, batch.prompts, batch.responses,
                                           batch.temperature)
        return common_convert.logprobs_to_pb(batch.ids, logprobs, 0, packed=request.packed, columnar=batch.columnar)

    async def GetInfo(self, request, context):
        return common_convert.info_to_pb("reference", self.engine.rank.model_path, 0,
                                         {"colocated": "trainer (actor.lora base model, adapters off)",
                                          "settings": settings_json(self.engine.rank.settings)})


SERVICE_NAME = trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name
REFERENCE_SERVICE_NAME = reference_pb2.DESCRIPTOR.services_by_name["Reference"].full_name


async def start(settings: TrainerSettings, address: str | None = None, *,
                engine: TrainerEngine | None = None) -> tuple[MeshServer, int, TrainerEngine]:
    """Rank 0's server. The engine (collective on every rank) is built here unless one is given."""
    # Built on the loop's thread: torch.cuda.set_device and process-group start-up belong to it.
    engine = engine or TrainerEngine(settings)
    rank = engine.rank
    token = settings.server.auth_token.get_secret_value() if settings.server.auth_token else None
    ws = settings.weight_sync
    check_transport(ws.transport, rank.device)
    auto = {}
    if ws.transport == "auto":
        placement = placement_of(rank.device)
        auto = dict(trainer=Placement(placement["host_id"], placement.get("device_uuid", "")),
                    grpc_bucket_bytes=rank.cfg.weight_bucket_bytes, device_bucket_bytes=ws.device_bucket_bytes,
                    on_choice=lambda target, transport, why: rank.resolved.record(
                        f"weight_sync.transport[{target}]", transport, "auto", why))
        rank.resolved.record("weight_sync.transport", "per replica", "auto",
                             "ipc to replicas on the trainer's GPU, nccl to other GPUs of this host, grpc otherwise"
                             if placement.get("device_uuid") else "the trainer is not on a CUDA device: grpc")
    else:
        rank.resolved.record("weight_sync.transport", ws.transport, ws.transport, "set explicitly")
    sender = build_sender(ws.transport, token=token, timeout=settings.server.call_timeout_s,
                          collective_timeout=ws.collective_timeout_s, **auto)
    # Before the server exists: SERVING means compiled.
    await asyncio.to_thread(engine.warm_up)
    servicers, names = [(trainer_pb2_grpc.add_TrainerServicer_to_server, TrainerServicer(engine, sender))], [SERVICE_NAME]
    if rank.cfg.lora is not None:
        servicers.append((reference_pb2_grpc.add_ReferenceServicer_to_server, BaseModelReference(engine)))
        names.append(REFERENCE_SERVICE_NAME)
    mesh, port = await create_server(servicers, names, address=address, config=settings.server)
    return mesh, port, engine
