"""gRPC servicer of the rollout service: converts and delegates to a RolloutEngine."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

import grpc

from meshrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.common import convert as common_convert
from services.common.config import settings_json
from services.common.rpc.server import MeshServer, create_server
from services.common.base_identity import base_id
from services.common.errors import FailedPrecondition
from services.common.tensors.weight_transport import decode_bucket, placement_of
from services.rollout import convert
from services.rollout.agents.env_client import EnvClient
from services.rollout.agents.episodes import EpisodeRunner
from services.rollout.config import RolloutSettings
from services.rollout.engines import build_engine
from services.rollout.types import RolloutEngine
from services.rollout.weight_receivers import DeviceBucketSpec, DeviceReceivers, IpcHandle

log = logging.getLogger("meshrl.rollout")


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, engine: RolloutEngine, settings: RolloutSettings):
        self.engine = engine
        self.defaults = settings.rollout
        self.settings = settings
        # ipc / nccl receivers, made on first use on the engine's device.
        self.receivers = DeviceReceivers(getattr(engine, "device", "cpu"))
        self.episodes = episode_runner(engine, settings)
        # The frozen base this replica holds (a LoRA trainer pushes adapters only onto its own base): the model
        # folder's digest, then whatever base a full update names ("" after merged weights: no base any more).
        self.base_id = base_id(engine.model_path) if engine.supports_adapters else ""
        log.info("rollout: %s", "serves LoRA adapters (a LoRA run pushes the adapter alone)" if engine.supports_adapters
                 else "serves no LoRA adapters (a LoRA run pushes merged weights)")

    async def Generate(self, request, context):
        batch = convert.request_from_pb(request, self.defaults)
        check_adapter(self.engine, batch.sampling.adapter)
        results = await self.engine.generate(batch)
        return convert.results_to_pb(results, packed=request.packed, columnar=request.columnar)

    async def GenerateEpisodes(self, request, context):
        agent = convert.agent_from_pb(request.agent, self.defaults.agent)
        sampling = convert.sampling_from_pb(request.sampling if request.HasField("sampling") else None, self.defaults)
        check_adapter(self.engine, sampling.adapter)
        groups = await self.episodes.run(convert.episode_prompts_from_pb(request), sampling, agent,
                                         partial_rollout=request.partial_rollout or "off")
        return convert.episodes_to_pb(groups)

    async def ComputeLogProbs(self, request, context):
        batch = common_convert.sequences_from_pb(request, as_lists=True)
        check_adapter(self.engine, request.adapter)
        # An engine serving adapters takes adapter= (its `logprobs` under that adapter; "" = the base).
        extra = {"adapter": request.adapter} if request.adapter else {}
        logprobs, version = await self.engine.logprobs(batch.prompts, batch.responses, batch.temperature, **extra)
        return common_convert.logprobs_to_pb(batch.ids, logprobs, weight_version=version, packed=request.packed,
                                             columnar=batch.columnar)

    async def UnloadAdapter(self, request, context):
        if not self.engine.supports_adapters:
            raise FailedPrecondition(f"UnloadAdapter: the {self.engine.info().get('engine', '?')} engine serves no "
                                     "LoRA adapters")
        unloaded = await self.engine.remove_adapter(request.name)
        log.info("adapter %r %s", request.name, "unloaded: its slot is free" if unloaded else "was not loaded")
        return rollout_pb2.UnloadAdapterResponse(name=request.name, unloaded=unloaded,
                                                 adapters=sorted(self.engine.loaded_adapters()))

    async def GetInfo(self, request, context):
        await self.engine.refresh()
        details = {**self.engine.info(), "supports_adapters": "true" if self.engine.supports_adapters else "false",
                   "base_id": self.base_id,
                   "weight_transports": ",".join(self.receivers.available()),
                   **placement_of(self.receivers.device),
                   "settings": settings_json(self.settings)}
        return common_convert.info_to_pb("rollout", self.engine.model_path, self.engine.weight_version, details)

    async def UpdateWeights(self, request_iterator, context):
        first = None
        async for first in request_iterator:
            break
        if first is None or not first.HasField("manifest"):
            raise ValueError("UpdateWeights: the first message must carry the manifest")
        manifest = convert.manifest_from_pb(first.manifest)
        transport = first.manifest.transport or "grpc"
        if manifest.adapter:
            self._check_adapter_update(manifest)
        elif transport == "grpc":
            done = await self.engine.update_weights(manifest, _buckets(request_iterator))
            self.base_id = manifest.base_id
            return common_pb2.UpdateWeightsResponse(**done)
        start = time.perf_counter()
        received = None
        if transport == "grpc":       # an adapter: small, received whole on the host
            received = await self.receivers.host.receive(manifest, _buckets(request_iterator))
            tensors, num_bytes = received.tensors, received.num_bytes
        else:
            tensors, num_bytes = await self.receivers.get(transport).receive(
                manifest, _device_buckets(request_iterator), group_id=first.manifest.group_id)
        received_s = time.perf_counter() - start
        if manifest.adapter:
            await self.engine.apply_adapter(manifest.adapter, manifest.version, json.loads(manifest.adapter_config),
                                            dict(tensors))
        else:
            await self.engine.apply_update(manifest.version, tensors)
            self.base_id = manifest.base_id
        if received is not None:
            self.receivers.host.keep(received)
        seconds = time.perf_counter() - start
        log.info("%s version %d applied over %s: %d tensors, %.1f MiB in %.3fs (received and checked in %.3fs)",
                 f"adapter {manifest.adapter!r}" if manifest.adapter else "weights", manifest.version, transport,
                 len(tensors), num_bytes / 2**20, seconds, received_s)
        return common_pb2.UpdateWeightsResponse(weight_version=self.engine.weight_version, num_bytes=num_bytes,
                                                seconds=seconds)

    def _check_adapter_update(self, manifest) -> None:
        """An adapter update is applied over the base it was trained on, or refused before its bytes move."""
        if not self.engine.supports_adapters:
            raise FailedPrecondition(f"manifest.adapter: {manifest.adapter!r}, but the "
                                     f"{self.engine.info().get('engine', '?')} engine serves no LoRA adapters; push "
                                     "merged full weights")
        if manifest.base_id != self.base_id:
            raise FailedPrecondition(f"manifest.base_id: the adapter belongs to base {manifest.base_id or '?'}, this "
                                     f"replica holds {self.base_id or 'no known base'}; push the base first")
        try:
            json.loads(manifest.adapter_config)
        except ValueError:
            raise ValueError("manifest.adapter_config: not JSON") from None

    async def JoinWeightGroup(self, request, context):
        receiver = self.receivers.get("nccl")
        uuid = await receiver.join(request.group_id, request.unique_id, request.rank, request.world_size,
                                   request.timeout_s)
        return common_pb2.WeightGroupResponse(group_id=request.group_id, device_uuid=uuid)


def check_adapter(engine: RolloutEngine, adapter: str) -> None:
    """A request naming an adapter is refused by an engine that serves none."""
    if adapter and not engine.supports_adapters:
        raise ValueError(f"sampling.adapter: {adapter!r}, but the {engine.info().get('engine', '?')} engine serves no "
                         "LoRA adapters (it holds merged weights); leave it empty")


def episode_runner(engine: RolloutEngine, settings: RolloutSettings) -> EpisodeRunner:
    """The replica's episode loop, calling the env replicas its `env:` section names (servers, dns, or the Redis
    registry at server.registry_url under run.redis_prefix). A section naming none is refused only when an
    episode needs tools or an environment."""
    section, server = settings.env, settings.server
    token = server.auth_token.get_secret_value() if server.auth_token else None
    env, missing = None, ""
    if section.registry and not server.registry_url:
        missing = ("env.registry: a rollout replica reads the service registry at server.registry_url; set it "
                   "(or list the env replicas in env.servers)")
    else:
        registry = None
        if section.registry:
            from services.common.rpc.registry import Registry

            registry = Registry(server.registry_url, prefix=settings.run.redis_prefix)
        env = EnvClient.from_section(section, registry=registry, token=token)
    return EpisodeRunner(engine, env, settings.rollout.agent, max_tokens=settings.rollout.max_tokens,
                         tool_call_parser=section.tool_call_parser, env_missing=missing)


async def _until_commit(request_iterator):
    """(message number, message) of every bucket message; returns at the sender's commit message and raises
    when the stream ends without one (a sender that died, even after its last byte) or goes on after it."""
    i, committed = 1, False
    async for msg in request_iterator:
        i += 1
        if committed:
            raise ValueError(f"UpdateWeights: message {i} follows the commit message")
        if msg.commit:
            if msg.HasField("manifest") or msg.HasField("device") or len(msg.data):
                raise ValueError(f"UpdateWeights: message {i}: the commit message carries nothing else")
            committed = True
            continue
        if msg.HasField("manifest"):
            raise ValueError(f"UpdateWeights: message {i} carries a second manifest")
        yield i, msg
    if not committed:
        raise ValueError("UpdateWeights: the stream ended without its commit message (the sender stopped "
                         "before committing); nothing was applied")


async def _buckets(request_iterator) -> AsyncIterator[tuple[bytes, int]]:
    async for i, msg in _until_commit(request_iterator):
        if msg.HasField("device"):
            raise ValueError(f"UpdateWeights: message {i} is a device bucket in a grpc update")
        yield msg.data, msg.crc32


async def _device_buckets(request_iterator) -> AsyncIterator[DeviceBucketSpec]:
    async for i, msg in _until_commit(request_iterator):
        if not msg.HasField("device"):
            raise ValueError(f"UpdateWeights: message {i} of a device update carries no device bucket")
        d = msg.device
        ipc = None
        if d.HasField("ipc"):
            h = d.ipc
            ipc = IpcHandle(h.device_uuid, h.handle, h.storage_bytes, h.storage_offset, h.ref_counter_handle,
                            h.ref_counter_offset, h.event_handle, h.event_sync_required, h.buffer_id)
        yield DeviceBucketSpec(d.offset, d.nbytes, d.checksum, ipc)


def add_rollout_servicer(servicer: RolloutServicer, server) -> None:
    """add_RolloutServicer_to_server, except that UpdateWeights reads payload buckets as views of the received
    bytes (decode_bucket) instead of copying them through protobuf."""
    capture = _HandlerCapture()
    rollout_pb2_grpc.add_RolloutServicer_to_server(servicer, capture)
    handlers = dict(capture.handlers)
    handlers["UpdateWeights"] = grpc.stream_unary_rpc_method_handler(
        servicer.UpdateWeights, request_deserializer=decode_bucket,
        response_serializer=common_pb2.UpdateWeightsResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(capture.name, handlers),))
    server.add_registered_method_handlers(capture.name, handlers)


class _HandlerCapture:
    """Stands in for a server to read the generated method handlers."""

    name, handlers = "", {}

    def add_generic_rpc_handlers(self, generic_handlers) -> None:
        pass

    def add_registered_method_handlers(self, name, handlers) -> None:
        self.name, self.handlers = name, handlers


SERVICE_NAME = rollout_pb2.DESCRIPTOR.services_by_name["Rollout"].full_name


@dataclass
class RolloutReplica:
    """What start() brings up besides the gRPC server: the engine and, when configured, the HTTP API."""

    engine: RolloutEngine
    http_port: int | None = None
    _http_runner: Any = None
    receivers: DeviceReceivers | None = None
    episodes: EpisodeRunner | None = None

    async def close(self) -> None:
        if self._http_runner is not None:
            await self._http_runner.cleanup()
            self._http_runner = None
        if self.receivers is not None:
            self.receivers.close()
        if self.episodes is not None and self.episodes.env is not None:
            await self.episodes.env.close()
        await self.engine.close()


async def start(settings: RolloutSettings, address: str | None = None, *,
                engine: RolloutEngine | None = None) -> tuple[MeshServer, int, RolloutReplica]:
    """Starts a replica: the engine `rollout.engine` names behind a gRPC server, plus the OpenAI-compatible
    HTTP API on `rollout.http_port` when that is set. `await replica.close()` stops the HTTP API."""
    engine = engine or build_engine(settings)
    replica = RolloutReplica(engine)
    r = settings.rollout
    warm_up = getattr(engine, "warm_up", None)
    if warm_up is not None:
        # Before the server exists: health answers SERVING only once the first batch costs what later ones do.
        try:
            await asyncio.to_thread(warm_up)
        except BaseException:
            await replica.close()
            raise
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
        servicer = RolloutServicer(engine, settings)
        replica.receivers = servicer.receivers
        replica.episodes = servicer.episodes
        mesh, port = await create_server([(add_rollout_servicer, servicer)], [SERVICE_NAME], address=address,
                                         config=settings.server)
    except BaseException:
        await replica.close()
        raise
    return mesh, port, replica
