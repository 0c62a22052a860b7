"""Weight senders: push the trainer's current weights to rollout replicas under a version.

`WeightSender` is the interface; `GrpcSender` ("grpc" transport) streams a manifest and CRC-checked
buckets over `Rollout.UpdateWeights` to every target concurrently. CUDA-IPC and NCCL senders plug in
beside it under their transport names.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Mapping, Protocol, Sequence

import grpc
import torch

from meshrl.v1 import common_pb2, rollout_pb2_grpc
from services.common.channel import create_channel
from services.common.weights import DEFAULT_BUCKET_BYTES, build_manifest, iter_buckets
from services.trainer.convert import manifest_to_pb

log = logging.getLogger("meshrl.trainer")


@dataclass
class PushOutcome:
    """Result of pushing one update to one replica."""

    target: str
    ok: bool
    error: str = ""
    seconds: float = 0.0


class WeightSender(Protocol):
    transport: str

    async def push(self, state: Mapping[str, torch.Tensor], version: int, targets: Sequence[str], *,
                   bucket_bytes: int) -> list[PushOutcome]:
        """Sends `state` as `version` to every target; a failing target never blocks the others."""
        ...


async def _messages(state: Mapping[str, torch.Tensor], version: int,
                    bucket_bytes: int) -> AsyncIterator[common_pb2.WeightBucket]:
    yield common_pb2.WeightBucket(manifest=manifest_to_pb(build_manifest(state, version)))
    # Buckets are cut lazily per target, so no target waits for one big payload buffer.
    for data, crc in iter_buckets(state, bucket_bytes):
        yield common_pb2.WeightBucket(data=data, crc32=crc)


class GrpcSender:
    """Streams weights over gRPC; works across hosts and with any replica engine."""

    transport = "grpc"

    def __init__(self, *, token: str | None = None, timeout: float | None = 600.0):
        self.token = token
        self.timeout = timeout

    async def _push_one(self, target: str, state, version: int, bucket_bytes: int) -> PushOutcome:
        t0 = time.perf_counter()
        try:
            # gRPC retries UNAVAILABLE only until the call commits (first bytes past its retry buffer),
            # so a stream is never applied twice; a stream that failed later is re-sent whole by the caller.
            async with create_channel(target, token=self.token, timeout=self.timeout) as channel:
                stub = rollout_pb2_grpc.RolloutStub(channel)
                # Token and deadline set on the call itself, so the push never depends on channel defaults.
                metadata = (("authorization", f"Bearer {self.token}"),) if self.token else None
                reply = await stub.UpdateWeights(_messages(state, version, bucket_bytes), metadata=metadata,
                                                 timeout=self.timeout)
            if reply.weight_version != version:
                return PushOutcome(target, False, f"replica reports version {reply.weight_version}, expected "
                                   f"{version}", time.perf_counter() - t0)
            return PushOutcome(target, True, "", time.perf_counter() - t0)
        except grpc.aio.AioRpcError as e:
            return PushOutcome(target, False, f"{e.code().name}: {e.details()}", time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - reported per target, never raised over the others
            return PushOutcome(target, False, f"{type(e).__name__}: {e}", time.perf_counter() - t0)

    async def push(self, state, version, targets, *, bucket_bytes=DEFAULT_BUCKET_BYTES) -> list[PushOutcome]:
        outcomes = await asyncio.gather(*(self._push_one(t, state, version, bucket_bytes) for t in targets))
        for o in outcomes:
            if not o.ok:
                log.warning("weight push of version %d to %s failed: %s", version, o.target, o.error)
        return list(outcomes)


SENDERS = {"grpc": GrpcSender}
