"""The grpc transport: a manifest and CRC-checked buckets streamed over `Rollout.UpdateWeights`, to every target
concurrently; works across hosts and with any replica engine (services/trainer/weights/senders.py)."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from meshrl.v1 import common_pb2
from services.common.tensors.weight_transport import HostPayload
from services.common.tensors.weights import DEFAULT_BUCKET_BYTES
from services.trainer.convert import manifest_to_pb
from services.trainer.weights.senders import NO_TAGS, ManifestTags, PushOutcome, RpcSender, error_text

UPDATE_WEIGHTS = "/meshrl.v1.Rollout/UpdateWeights"

log = logging.getLogger("meshrl.trainer")


class GrpcSender(RpcSender):
    """Streams weights over gRPC; works across hosts and with any replica engine."""

    transport = "grpc"
    on_device = False
    # The stream goes without gRPC's retries: they buffer it to replay, and a replica killed while a push was
    # queued on its reconnecting channel once aborted the trainer inside that code (gRPC core's check
    # `pending == nullptr`, buffered_call.cc). UNAVAILABLE is retried here instead, once, whole, on a fresh
    # channel: a replica that gets one version twice applies the same weights twice.
    max_attempts = 1

    async def _push_one(self, target: str, payload: HostPayload, manifest_message: bytes) -> PushOutcome:
        t0 = time.perf_counter()
        for attempt in range(2):
            try:
                async with self.channel(target) as channel:
                    # Raw bytes out: the bucket messages are encoded by HostPayload, not by protobuf.
                    call = channel.stream_unary(UPDATE_WEIGHTS, request_serializer=None,
                                                response_deserializer=common_pb2.UpdateWeightsResponse.FromString)
                    reply = await call(payload.messages(manifest_message), metadata=self.metadata,
                                       timeout=self.timeout)
                return self._check(target, reply, payload.manifest.version, t0)
            except grpc.aio.AioRpcError as e:
                # A connection that went away under the call (GOAWAY at the server's max_connection_age, a
                # restart): the channel was dropped, the next attempt connects anew.
                if attempt == 0 and e.code() == grpc.StatusCode.UNAVAILABLE:
                    log.info("weight push to %s: %s; sending it again", target, e.details())
                    continue
                return PushOutcome(target, False, error_text(e), time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - reported per target, never raised over the others
                return PushOutcome(target, False, error_text(e), time.perf_counter() - t0)
        raise AssertionError("unreachable")

    async def push(self, state, version, targets, *, bucket_bytes=DEFAULT_BUCKET_BYTES,
                   tags: ManifestTags = NO_TAGS) -> list[PushOutcome]:
        payload = HostPayload(state, version, bucket_bytes)
        manifest_message = common_pb2.WeightBucket(manifest=tags.apply(manifest_to_pb(payload.manifest))
                                                   ).SerializeToString()
        payload.start()
        try:
            outcomes = await asyncio.gather(*(self._push_one(t, payload, manifest_message) for t in targets))
        finally:
            payload.close()
        return self._report(version, outcomes)
