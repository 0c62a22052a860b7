"""Coordinator gRPC service: the run API over RunManager, plus `python -m coordinator` to serve it."""

from __future__ import annotations

import asyncio
import logging

from pydantic import Field

from coordinator.recipe.config import TrainerSection
from coordinator.runapi import observe
from coordinator.runapi.default_pools import DefaultPools, replica_statuses
from coordinator.runapi.runs import RunManager
from coordinator.runapi.store import RunRecord, open_store
from meshrl.v1 import coordinator_pb2, coordinator_pb2_grpc
from services.common.config import MeshSettings, Section, ServerConfig
from services.common.rpc.server import MeshServer, create_server
from services.reference.config import ReferenceConfig
from services.reward.config import RewardConfig
from services.rollout.config import RolloutConfig

log = logging.getLogger("meshrl.coordinator")

STATES = {name: getattr(coordinator_pb2, f"RUN_STATE_{name}") for name in
          ("PENDING", "RUNNING", "PAUSED", "COMPLETED", "FAILED", "STOPPED")}


class CoordinatorRunSection(Section):
    """The parts of `run:` the coordinator process itself reads (the rest belongs to each run)."""

    model_config = Section.model_config | {"extra": "ignore"}
    redis_url: str = ""
    # Key prefix of this coordinator's run state in Redis (separate deployments can share a server).
    redis_prefix: str = "meshrl"
    resume: bool = Field(True, description="resume unfinished runs found in the store at start-up")
    # Where a run that sets no run.run_dir writes its folder (`meshrl mesh --run-dir`, the recipe's run.run_dir).
    run_dir: str = "runs"


class CoordinatorSettings(MeshSettings):
    run: CoordinatorRunSection = CoordinatorRunSection()
    server: ServerConfig = ServerConfig()
    # The coordinator's default pools (ListServices with no run id); each run's config brings its own.
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    reference: ReferenceConfig = ReferenceConfig()
    # The mesh's trainer (`meshrl up` and `meshrl mesh` fill it in): a run whose recipe names none trains there.
    trainer: TrainerSection = TrainerSection()


def record_to_pb(r: RunRecord) -> coordinator_pb2.RunStatus:
    return coordinator_pb2.RunStatus(run_id=r.run_id, state=STATES[r.state], step=r.step, num_steps=r.num_steps,
                                     weight_version=r.weight_version, data_position=r.data_position,
                                     checkpoint_path=r.checkpoint_path, message=r.message, run_dir=r.run_dir,
                                     last_metrics=r.last_metrics, config=r.effective_config,
                                     adapter=r.adapter, pending_command=r.pending_command)


def metrics_to_pb(run_id: str, m: dict) -> coordinator_pb2.StepMetrics:
    return coordinator_pb2.StepMetrics(run_id=run_id, step=int(m["step"]), timestamp=m.get("timestamp", 0.0),
                                       metrics={k: v for k, v in m.items() if k not in ("step", "timestamp")})


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, manager: RunManager, default_pools: DefaultPools | None = None):
        self.manager = manager
        self.default_pools = default_pools or DefaultPools({})

    async def StartRun(self, request, context):
        return coordinator_pb2.StartRunResponse(run_id=await self.manager.start_run(request.config, request.run_id))

    async def GetRun(self, request, context):
        return record_to_pb(await self.manager.get(request.run_id))

    async def ListRuns(self, request, context):
        return coordinator_pb2.ListRunsResponse(runs=[record_to_pb(r) for r in await self.manager.store.list()])

    async def StreamMetrics(self, request, context):
        # Metric records are append-only, so an index into the list is a cursor.
        sent = 0
        while True:
            records = await self.manager.metrics(request.run_id, request.from_step)
            for m in records[sent:]:
                yield metrics_to_pb(request.run_id, m)
            sent = len(records)
            record = await self.manager.get(request.run_id)
            if record.state in ("COMPLETED", "FAILED", "STOPPED") and request.run_id not in self.manager.tasks:
                for m in (await self.manager.metrics(request.run_id, request.from_step))[sent:]:
                    yield metrics_to_pb(request.run_id, m)
                return
            await self.manager.wait_for_change(request.run_id, timeout=1.0)

    async def PauseRun(self, request, context):
        return record_to_pb(await self.manager.command(request.run_id, "pause"))

    async def ResumeRun(self, request, context):
        return record_to_pb(await self.manager.command(request.run_id, "resume"))

    async def StopRun(self, request, context):
        return record_to_pb(await self.manager.command(request.run_id, "stop"))

    async def SaveCheckpoint(self, request, context):
        from coordinator.runapi import recovery
        from coordinator.training import remote

        record = await self.manager.get(request.run_id)
        ctx = self.manager.contexts.get(request.run_id)
        if ctx is None:
            from services.common.errors import FailedPrecondition

            raise FailedPrecondition(f"run {request.run_id!r} is not active")
        saved = await remote.save_checkpoint(ctx.trainer, str(ctx.run_dir / "checkpoints" / f"step_{ctx.step}"))
        record = await self.manager.get(request.run_id)
        recovery.note_checkpoint(record, saved)     # with the run step the trainer says the weights are
        await self.manager.store.put(record)
        return record_to_pb(record)

    async def ListServices(self, request, context):
        if request.run_id:
            await self.manager.get(request.run_id)  # NOT_FOUND for a run this coordinator does not know
            ctx = self.manager.contexts.get(request.run_id)  # a finished run has no pools left
            pools = [p for p in (ctx.rollout, ctx.reward, ctx.reference) if p is not None] if ctx else []
        else:
            pools = await self.default_pools.refresh()
        return coordinator_pb2.ListServicesResponse(replicas=replica_statuses(pools, self.manager.contexts.values()))


SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name


class CoordinatorEngine:
    """What `start` returns: the manager plus its shutdown."""

    def __init__(self, manager: RunManager, default_pools: DefaultPools | None = None):
        self.manager = manager
        self.default_pools = default_pools

    async def close(self) -> None:
        await self.manager.close()
        if self.default_pools is not None:
            await self.default_pools.close()


async def start(settings: CoordinatorSettings, address: str | None = None
                ) -> tuple[MeshServer, int, CoordinatorEngine]:
    registry = None
    if settings.run.redis_url:
        from services.common.rpc.registry import Registry

        registry = Registry(settings.run.redis_url, prefix=settings.run.redis_prefix)
    token = settings.server.auth_token.get_secret_value() if settings.server.auth_token else None
    # The mesh's replicas: ListServices with no run id, and the pools of a run whose recipe lists none.
    pools = DefaultPools({"rollout": settings.rollout, "reward": settings.reward, "reference": settings.reference},
                         registry=registry, token=token, trainer_address=settings.trainer.address)
    # The store is wrapped so /metrics reports each run's state (coordinator/runapi/observe.py).
    manager = RunManager(observe.ObservedStore(open_store(settings.run.redis_url, settings.run.redis_prefix)),
                         registry=registry, defaults=pools, run_dir=settings.run.run_dir)
    observe.observe_manager(manager)
    mesh, port = await create_server([(coordinator_pb2_grpc.add_CoordinatorServicer_to_server,
                                       CoordinatorServicer(manager, pools))], [SERVICE_NAME], address=address,
                                     config=settings.server)
    if settings.run.resume:
        try:
            resumed = await manager.resume_unfinished()
            if resumed:
                log.info("resumed runs: %s", resumed)
        except Exception:  # noqa: BLE001 - a run that cannot resume must not stop the API from serving
            log.exception("could not resume unfinished runs")
    return mesh, port, CoordinatorEngine(manager, pools)
