"""Weight senders: push the trainer's current weights to rollout replicas under a version.

`WeightSender` is the interface; `build_sender` (services/trainer/weights/choice.py) picks one by
`weight_sync.transport` (`auto`: per replica). One module per transport:
- "grpc" (grpc_sender.py): a manifest and CRC-checked buckets streamed over `Rollout.UpdateWeights` to every
  target concurrently; works across hosts and with every engine. CRCs are computed once per push and the
  bucket messages skip protobuf (services/common/tensors/weight_transport.py), so the stream runs near the
  speed of a raw-bytes gRPC stream.
- "ipc" (ipc_sender.py): trainer and replica share a GPU. The weights are packed into device staging buffers
  kept across pushes; their CUDA IPC handles travel over `UpdateWeights` and the replica copies from them
  on the device (no host round trip).
- "nccl" (nccl_sender.py): rank 0 and every replica's GPU form one NCCL communicator (CuPy's
  `cupy.cuda.nccl`; the unique id travels over `Rollout.JoinWeightGroup`); buckets are packed into two device
  buffers in turn and broadcast while the next one packs. Every collective has a deadline: on a timeout the
  communicator is aborted, the push fails with an error naming the timeout, replicas keep their old
  version, and the next push forms a new group (as it does whenever the set of targets changes).
Every update carries its version; a replica applies it only when every bucket arrived and checked out. This
module holds what every sender shares: the outcome of a push, kept channels, and the device transports'
staging rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

import grpc
import torch

from meshrl.v1 import common_pb2
from services.common.rpc.channel import create_channel
from services.common.tensors.weight_transport import DevicePlan
from services.trainer.convert import manifest_to_pb

log = logging.getLogger("meshrl.trainer")

DEVICE_BUCKET_BYTES = 128 * 1024 * 1024


@dataclass(frozen=True)
class ManifestTags:
    """What a push says about its tensors besides their layout (WeightManifest.adapter / adapter_config / base_id):
    empty for full weights of no known base."""

    adapter: str = ""
    adapter_config: str = ""
    base_id: str = ""

    def apply(self, pb: common_pb2.WeightManifest) -> common_pb2.WeightManifest:
        pb.adapter, pb.adapter_config, pb.base_id = self.adapter, self.adapter_config, self.base_id
        return pb


NO_TAGS = ManifestTags()


@dataclass
class PushOutcome:
    """Result of pushing one update to one replica."""

    target: str
    ok: bool
    error: str = ""
    seconds: float = 0.0
    # The replica's own account of the push: from its first message to the update applied (receive, check, load).
    replica_seconds: float = 0.0


class WeightSender(Protocol):
    transport: str
    # Whether push() wants the state on the trainer's device (True) or as CPU tensors (False).
    on_device: bool

    async def push(self, state: Mapping[str, torch.Tensor], version: int, targets: Sequence[str], *,
                   bucket_bytes: int, tags: ManifestTags = NO_TAGS) -> list[PushOutcome]:
        """Sends `state` as `version` to every target; a failing target never blocks the others. tags: an adapter's
        name and config, the base the weights belong to."""
        ...

    def close(self) -> None:
        """Frees staging buffers and communicators."""
        ...


def error_text(e: BaseException) -> str:
    """What a failed push reports for one target: a gRPC status by its name, any other error by its type."""
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    return f"{type(e).__name__}: {e}"


class RpcSender:
    """What every transport shares: one channel per target kept across pushes, the token and deadline on
    every call.

    A new channel per push costs a TCP connect and an HTTP/2 handshake per replica on every update (14% of
    a small model's GRPO step on CPU, bench/README.md); channels are kept per (event loop, target), since a
    grpc.aio channel belongs to the loop it was made on, and dropped when a call on them fails.
    """

    # gRPC's attempts per call (create_channel): its retry of UNAVAILABLE before the call commits. The update
    # streams go without it (pushed(): max_attempts 1 on their senders).
    max_attempts = 4

    def __init__(self, *, token: str | None = None, timeout: float | None = 600.0):
        self.token = token
        self.timeout = timeout
        self._channels: dict[tuple[int, str], grpc.aio.Channel] = {}

    @property
    def metadata(self):
        # Token and deadline set on the call itself, so the push never depends on channel defaults.
        return (("authorization", f"Bearer {self.token}"),) if self.token else None

    @contextlib.asynccontextmanager
    async def channel(self, target: str):
        """The kept channel to `target` (made on first use); a failed call drops it, so the next push
        starts from a fresh connection."""
        key = (id(asyncio.get_running_loop()), target)
        channel = self._channels.get(key)
        if channel is None:
            channel = self._channels[key] = create_channel(target, token=self.token, timeout=self.timeout,
                                                           max_attempts=self.max_attempts)
        try:
            yield channel
        except BaseException:
            if self._channels.get(key) is channel:
                del self._channels[key]
                await channel.close()
            raise

    async def aclose(self) -> None:
        """Closes the kept channels of the running loop."""
        loop = id(asyncio.get_running_loop())
        for key in [k for k in self._channels if k[0] == loop]:
            await self._channels.pop(key).close()

    async def pushed(self, target: str, version: int, call) -> PushOutcome:
        """The outcome of one update stream to `target`, `call(channel)` -> its UpdateWeightsResponse.

        The streams go without gRPC's retries (max_attempts 1 on the senders that use this): they buffer a stream
        to replay it, and a replica killed while a push was queued on its reconnecting channel once aborted the
        trainer inside that code (gRPC core's check `pending == nullptr`, buffered_call.cc). A stream that meets
        UNAVAILABLE (a connection closed under it at the replica's max_connection_age, a restart) is sent again
        here, once, whole, on a fresh channel: a replica given one version twice applies the same weights twice."""
        t0 = time.perf_counter()
        for attempt in range(2):
            try:
                async with self.channel(target) as channel:       # a failed call drops the channel
                    reply = await call(channel)
                return self._check(target, reply, version, t0)
            except grpc.aio.AioRpcError as e:
                if attempt == 0 and e.code() == grpc.StatusCode.UNAVAILABLE:
                    log.info("weight push to %s: %s; sending it again", target, e.details())
                    continue
                return PushOutcome(target, False, error_text(e), time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - reported per target, never raised over the others
                return PushOutcome(target, False, error_text(e), time.perf_counter() - t0)
        raise AssertionError("unreachable")

    def _check(self, target: str, reply, version: int, t0: float) -> PushOutcome:
        if reply.weight_version != version:
            return PushOutcome(target, False, f"replica reports version {reply.weight_version}, expected {version}",
                               time.perf_counter() - t0)
        return PushOutcome(target, True, "", time.perf_counter() - t0, replica_seconds=reply.seconds)

    @staticmethod
    def _report(version: int, outcomes: Sequence[PushOutcome]) -> list[PushOutcome]:
        for o in outcomes:
            if not o.ok:
                log.warning("weight push of version %d to %s failed: %s", version, o.target, o.error)
        return list(outcomes)

    def close(self) -> None:
        return None


# --------------------------------------------------------------------------------------------------
# What the device transports (ipc, nccl) share


def device_of(state: Mapping[str, torch.Tensor]) -> torch.device:
    devices = {t.device for t in state.values()}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(f"weight_sync.transport: ipc and nccl need the weights on one CUDA device, got "
                         f"{sorted(str(d) for d in devices)}")
    return next(iter(devices))


def device_manifest(plan: DevicePlan, transport: str, group_id: str = "",
                    tags: ManifestTags = NO_TAGS) -> common_pb2.WeightManifest:
    pb = tags.apply(manifest_to_pb(plan.manifest))
    pb.transport = transport
    pb.group_id = group_id
    return pb


class ManifestMessage:
    """The manifest message of a device push, made once per layout, transport, group and tags (an adapter's 392
    TensorSpecs take about a millisecond to build) and copied for each push under its version."""

    def __init__(self):
        self._key: tuple | None = None
        self._pb: common_pb2.WeightManifest | None = None

    def __call__(self, plan: DevicePlan, transport: str, group_id: str = "",
                 tags: ManifestTags = NO_TAGS) -> common_pb2.WeightBucket:
        key = (plan.signature(), plan.manifest.total_bytes, transport, group_id, tags)
        if key != self._key:
            self._key, self._pb = key, device_manifest(plan, transport, group_id, tags)
        message = common_pb2.WeightBucket()
        message.manifest.CopyFrom(self._pb)
        message.manifest.version = plan.manifest.version
        return message


# The last message of a device transport's update: every bucket is there, apply them.
COMMIT = common_pb2.WeightBucket(commit=True)


def device_bucket_bytes(n: int) -> int:
    """Buckets in whole 4-byte words, so each one's checksum sums int32 words (device_checksum)."""
    return max(4, (int(n) + 3) // 4 * 4)
