"""The grpc transport: a manifest and CRC-checked buckets streamed over `Rollout.UpdateWeights`, to every target
concurrently; works across hosts and with any replica engine (services/trainer/weights/senders.py)."""

from __future__ import annotations

import asyncio

from meshrl.v1 import common_pb2
from services.common.tensors.weight_transport import HostPayload
from services.common.tensors.weights import DEFAULT_BUCKET_BYTES
from services.trainer.convert import manifest_to_pb
from services.trainer.weights.senders import NO_TAGS, ManifestTags, PushOutcome, RpcSender

UPDATE_WEIGHTS = "/meshrl.v1.Rollout/UpdateWeights"


class GrpcSender(RpcSender):
    """Streams weights over gRPC; works across hosts and with any replica engine."""

    transport = "grpc"
    on_device = False
    max_attempts = 1               # the sender's own retry (RpcSender.pushed)

    async def _push_one(self, target: str, payload: HostPayload, manifest_message: bytes) -> PushOutcome:
        async def call(channel):
            # Raw bytes out: the bucket messages are encoded by HostPayload, not by protobuf.
            stream = channel.stream_unary(UPDATE_WEIGHTS, request_serializer=None,
                                          response_deserializer=common_pb2.UpdateWeightsResponse.FromString)
            return await stream(payload.messages(manifest_message), metadata=self.metadata, timeout=self.timeout)
        return await self.pushed(target, payload.manifest.version, call)

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
