"""Weight senders: push the trainer's current weights to rollout replicas under a version.

`WeightSender` is the interface, and `build_sender` (services/trainer/weights/choice.py) picks one by
`weight_sync.transport` (`auto`: per replica):
- "grpc": a manifest and CRC-checked buckets streamed over `Rollout.UpdateWeights` to every target
  concurrently; works across hosts and with every engine. CRCs are computed once per push and the
  bucket messages skip protobuf (services/common/weight_transport.py), so the stream runs near the
  speed of a raw-bytes gRPC stream.
- "ipc": trainer and replica share a GPU. The weights are packed into device staging buffers kept
  across pushes; their CUDA IPC handles travel over `UpdateWeights` and the replica copies from them
  on the device (no host round trip).
- "nccl": rank 0 and every replica's GPU form one NCCL communicator (CuPy's `cupy.cuda.nccl`; the
  unique id travels over `Rollout.JoinWeightGroup`); buckets are packed into two device buffers in
  turn and broadcast while the next one packs. Every collective has a deadline: on a timeout the
  communicator is aborted, the push fails with an error naming the timeout, replicas keep their old
  version, and the next push forms a new group (as it does whenever the set of targets changes).
Every update carries its version; a replica applies it only when every bucket arrived and checked out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

import grpc
import torch

from meshrl.v1 import common_pb2, rollout_pb2_grpc
from services.common.channel import create_channel
from services.common.weight_transport import (DevicePlan, HostPayload, abort_communicator, device_checksum, device_uuid,
                                              flat_bytes, init_communicator, nccl_unique_id_bytes, wait_stream_done)
from services.common.weights import DEFAULT_BUCKET_BYTES
from services.trainer.convert import manifest_to_pb

log = logging.getLogger("meshrl.trainer")

UPDATE_WEIGHTS = "/meshrl.v1.Rollout/UpdateWeights"
DEVICE_BUCKET_BYTES = 128 * 1024 * 1024


@dataclass
class PushOutcome:
    """Result of pushing one update to one replica."""

    target: str
    ok: bool
    error: str = ""
    seconds: float = 0.0


class WeightSender(Protocol):
    transport: str
    # Whether push() wants the state on the trainer's device (True) or as CPU tensors (False).
    on_device: bool

    async def push(self, state: Mapping[str, torch.Tensor], version: int, targets: Sequence[str], *,
                   bucket_bytes: int) -> list[PushOutcome]:
        """Sends `state` as `version` to every target; a failing target never blocks the others."""
        ...

    def close(self) -> None:
        """Frees staging buffers and communicators."""
        ...


def _error(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    return f"{type(e).__name__}: {e}"


class _RpcSender:
    """What every transport shares: one channel per target kept across pushes, the token and deadline on
    every call.

    A new channel per push costs a TCP connect and an HTTP/2 handshake per replica on every update (14% of
    a small model's GRPO step on CPU, bench/README.md); channels are kept per (event loop, target), since a
    grpc.aio channel belongs to the loop it was made on, and dropped when a call on them fails.
    """

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
            channel = self._channels[key] = create_channel(target, token=self.token, timeout=self.timeout)
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

    def _check(self, target: str, reply, version: int, t0: float) -> PushOutcome:
        if reply.weight_version != version:
            return PushOutcome(target, False, f"replica reports version {reply.weight_version}, expected {version}",
                               time.perf_counter() - t0)
        return PushOutcome(target, True, "", time.perf_counter() - t0)

    @staticmethod
    def _report(version: int, outcomes: Sequence[PushOutcome]) -> list[PushOutcome]:
        for o in outcomes:
            if not o.ok:
                log.warning("weight push of version %d to %s failed: %s", version, o.target, o.error)
        return list(outcomes)

    def close(self) -> None:
        return None


class GrpcSender(_RpcSender):
    """Streams weights over gRPC; works across hosts and with any replica engine."""

    transport = "grpc"
    on_device = False

    async def _push_one(self, target: str, payload: HostPayload, manifest_message: bytes) -> PushOutcome:
        t0 = time.perf_counter()
        try:
            # gRPC retries UNAVAILABLE only until the call commits (first bytes past its retry buffer),
            # so a stream is never applied twice; a stream that failed later is re-sent whole by the caller.
            async with self.channel(target) as channel:
                # Raw bytes out: the bucket messages are encoded by HostPayload, not by protobuf.
                call = channel.stream_unary(UPDATE_WEIGHTS, request_serializer=None,
                                            response_deserializer=common_pb2.UpdateWeightsResponse.FromString)
                reply = await call(payload.messages(manifest_message), metadata=self.metadata, timeout=self.timeout)
            return self._check(target, reply, payload.manifest.version, t0)
        except Exception as e:  # noqa: BLE001 - reported per target, never raised over the others
            return PushOutcome(target, False, _error(e), time.perf_counter() - t0)

    async def push(self, state, version, targets, *, bucket_bytes=DEFAULT_BUCKET_BYTES) -> list[PushOutcome]:
        payload = HostPayload(state, version, bucket_bytes)
        manifest_message = common_pb2.WeightBucket(manifest=manifest_to_pb(payload.manifest)).SerializeToString()
        payload.start()
        try:
            outcomes = await asyncio.gather(*(self._push_one(t, payload, manifest_message) for t in targets))
        finally:
            payload.close()
        return self._report(version, outcomes)


# --------------------------------------------------------------------------------------------------
# Device transports


def _device_of(state: Mapping[str, torch.Tensor]) -> torch.device:
    devices = {t.device for t in state.values()}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(f"weight_sync.transport: ipc and nccl need the weights on one CUDA device, got "
                         f"{sorted(str(d) for d in devices)}")
    return next(iter(devices))


def _device_manifest(plan: DevicePlan, transport: str, group_id: str = "") -> common_pb2.WeightManifest:
    pb = manifest_to_pb(plan.manifest)
    pb.transport = transport
    pb.group_id = group_id
    return pb


class IpcSender(_RpcSender):
    """CUDA IPC: replicas on the trainer's GPU copy the weights straight from its staging buffers.

    The staging buffers (one per bucket, the payload's size in all) are allocated once and shared once;
    a replica opens each handle once and keeps it open across updates.
    """

    transport = "ipc"
    on_device = True

    def __init__(self, *, token: str | None = None, timeout: float | None = 600.0):
        super().__init__(token=token, timeout=timeout)
        self._signature = None
        self._buffers: list[torch.Tensor] = []
        self._handles: list[common_pb2.CudaIpcHandle] = []

    def _stage(self, state, version: int, bucket_bytes: int) -> tuple[DevicePlan, list[int]]:
        device = _device_of(state)
        plan = DevicePlan.build(state, version, bucket_bytes)
        with torch.cuda.device(device):
            if plan.signature() != self._signature:
                self._buffers = [torch.empty(n, dtype=torch.uint8, device=device) for _, n, _ in plan.buckets]
                self._handles = [self._share(b, device) for b in self._buffers]
                self._signature = plan.signature()
            flats = [flat_bytes(t) for t in state.values()]
            for k, buf in enumerate(self._buffers):
                plan.pack(k, flats, buf)
            sums = torch.stack([device_checksum(b) for b in self._buffers]).tolist()
            torch.cuda.current_stream(device).synchronize()    # the bytes are there before any handle is read
        return plan, sums

    @staticmethod
    def _share(buf: torch.Tensor, device: torch.device) -> common_pb2.CudaIpcHandle:
        from torch.multiprocessing.reductions import reduce_tensor

        # The same call torch.multiprocessing makes when it sends a CUDA tensor to another process.
        _, args = reduce_tensor(buf)
        (_, _, _, _, _, _, _, handle, storage_bytes, storage_offset, _, rc_handle, rc_offset, ev_handle,
         ev_sync) = args
        return common_pb2.CudaIpcHandle(
            device_uuid=device_uuid(device), handle=handle, storage_bytes=storage_bytes,
            storage_offset=storage_offset, ref_counter_handle=rc_handle or b"", ref_counter_offset=rc_offset or 0,
            event_handle=ev_handle or b"", event_sync_required=bool(ev_sync), buffer_id=uuid.uuid4().hex)

    def _messages(self, plan: DevicePlan, sums: list[int]):
        yield common_pb2.WeightBucket(manifest=_device_manifest(plan, "ipc"))
        for (offset, nbytes, _), checksum, handle in zip(plan.buckets, sums, self._handles):
            yield common_pb2.WeightBucket(device=common_pb2.DeviceBucket(offset=offset, nbytes=nbytes,
                                                                         checksum=checksum, ipc=handle))
        yield _COMMIT

    async def _push_one(self, target: str, plan: DevicePlan, sums: list[int]) -> PushOutcome:
        t0 = time.perf_counter()
        try:
            async with self.channel(target) as channel:
                reply = await rollout_pb2_grpc.RolloutStub(channel).UpdateWeights(
                    _aiter(self._messages(plan, sums)), metadata=self.metadata, timeout=self.timeout)
            return self._check(target, reply, plan.manifest.version, t0)
        except Exception as e:  # noqa: BLE001
            return PushOutcome(target, False, _error(e), time.perf_counter() - t0)

    async def push(self, state, version, targets, *, bucket_bytes=DEVICE_BUCKET_BYTES) -> list[PushOutcome]:
        try:
            plan, sums = await asyncio.to_thread(self._stage, state, version, _device_bucket_bytes(bucket_bytes))
        except Exception as e:  # noqa: BLE001
            return self._report(version, [PushOutcome(t, False, f"ipc staging failed: {_error(e)}") for t in targets])
        outcomes = await asyncio.gather(*(self._push_one(t, plan, sums) for t in targets))
        return self._report(version, outcomes)

    def close(self) -> None:
        self._buffers, self._handles, self._signature = [], [], None


_COMMIT = common_pb2.WeightBucket(commit=True)


async def _aiter(items):
    for item in items:
        yield item


def _device_bucket_bytes(n: int) -> int:
    return max(4, (int(n) + 3) // 4 * 4)


@dataclass
class _Group:
    members: tuple[str, ...]
    group_id: str
    comm: object
    device: torch.device


class NcclSender(_RpcSender):
    """NCCL broadcast from trainer rank 0 to every replica's GPU; groups re-form when the targets change."""

    transport = "nccl"
    on_device = True

    def __init__(self, *, token: str | None = None, timeout: float | None = 600.0,
                 collective_timeout: float = 120.0):
        super().__init__(token=token, timeout=timeout)
        self.collective_timeout = collective_timeout
        self.group: _Group | None = None
        self._buffers: list[torch.Tensor] = []

    # ---- group formation

    async def _reachable(self, targets: Sequence[str]) -> dict[str, str]:
        """Targets that do not answer GetInfo within a few seconds, with the error (they are not waited for)."""
        async def probe(t):
            try:
                async with self.channel(t) as ch:
                    await rollout_pb2_grpc.RolloutStub(ch).GetInfo(common_pb2.GetInfoRequest(), metadata=self.metadata,
                                                                    timeout=10.0)
                return t, ""
            except Exception as e:  # noqa: BLE001
                return t, _error(e)
        return {t: err for t, err in await asyncio.gather(*(probe(t) for t in targets)) if err}

    async def _form(self, targets: Sequence[str], device: torch.device) -> dict[str, str]:
        """Forms a group of rank 0 and `targets` (ranks 1..n); returns {target: error} of those that failed."""
        from cupy.cuda import nccl

        self._drop_group()
        uid = nccl.get_unique_id()
        group_id = uuid.uuid4().hex[:12]
        world = len(targets) + 1

        async def join(rank: int, target: str):
            try:
                async with self.channel(target) as ch:
                    await rollout_pb2_grpc.RolloutStub(ch).JoinWeightGroup(
                        common_pb2.WeightGroupRequest(group_id=group_id, unique_id=nccl_unique_id_bytes(uid),
                                                      rank=rank, world_size=world,
                                                      timeout_s=self.collective_timeout),
                        metadata=self.metadata, timeout=self.collective_timeout + 10)
                return target, ""
            except Exception as e:  # noqa: BLE001
                return target, _error(e)

        init = asyncio.ensure_future(asyncio.to_thread(init_communicator, uid, world, 0, device,
                                                       self.collective_timeout))
        joined = await asyncio.gather(*(join(i + 1, t) for i, t in enumerate(targets)))
        errors = {t: err for t, err in joined if err}
        try:
            comm = await init
        except Exception as e:  # noqa: BLE001
            return {t: errors.get(t) or f"nccl group {group_id}: {e}" for t in targets}
        if errors:
            abort_communicator(comm)
            return {t: errors.get(t) or f"nccl group {group_id}: another member failed to join" for t in targets}
        self.group = _Group(tuple(targets), group_id, comm, device)
        log.info("nccl weight group %s formed: trainer + %d replicas on %s", group_id, len(targets), device)
        return {}

    def _drop_group(self) -> None:
        if self.group is not None:
            abort_communicator(self.group.comm)
            self.group = None

    # ---- one broadcast

    def _broadcast(self, plan: DevicePlan, state, queues, loop) -> None:
        """Packs bucket k+1 while bucket k is broadcast (two staging buffers in turn), telling each replica
        stream about every bucket before its broadcast starts. Runs in a worker thread."""
        from cupy.cuda import nccl
        import cupy

        group = self.group
        device = group.device
        deadline = time.monotonic() + self.collective_timeout
        with torch.cuda.device(device), cupy.cuda.Device(device.index):
            if len(self._buffers) != 2 or self._buffers[0].numel() < plan.bucket_bytes:
                self._buffers = [torch.empty(plan.bucket_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
            pack_stream, comm_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)
            pack_stream.wait_stream(torch.cuda.current_stream(device))     # the weights are final
            flats = [flat_bytes(t) for t in state.values()]
            done: list[torch.cuda.Event | None] = [None, None]
            for k, (offset, nbytes, _) in enumerate(plan.buckets):
                buf = self._buffers[k % 2]
                if done[k % 2] is not None:                   # bucket k-2 left this buffer
                    wait_stream_done(done[k % 2], deadline, f"broadcast of bucket {k - 2}")
                with torch.cuda.stream(pack_stream):
                    plan.pack(k, flats, buf)
                    checksum = int(device_checksum(buf[:nbytes]))     # syncs the pack stream only
                packed = torch.cuda.Event()
                packed.record(pack_stream)
                message = common_pb2.WeightBucket(device=common_pb2.DeviceBucket(offset=offset, nbytes=nbytes,
                                                                                 checksum=checksum))
                for q in queues:
                    loop.call_soon_threadsafe(q.put_nowait, message)
                comm_stream.wait_event(packed)
                group.comm.broadcast(buf.data_ptr(), buf.data_ptr(), nbytes, nccl.NCCL_UINT8, 0,
                                     comm_stream.cuda_stream)
                done[k % 2] = torch.cuda.Event()
                done[k % 2].record(comm_stream)
            for k, ev in enumerate(done):
                if ev is not None:
                    wait_stream_done(ev, deadline, "the last broadcast")

    async def _push_group(self, state, plan: DevicePlan) -> list[PushOutcome]:
        group = self.group
        loop = asyncio.get_running_loop()
        queues = [asyncio.Queue() for _ in group.members]
        manifest = common_pb2.WeightBucket(manifest=_device_manifest(plan, "nccl", group.group_id))

        async def stream(q):
            yield manifest
            for _ in range(len(plan.buckets) + 1):      # every bucket, then the commit once all broadcasts ended
                item = await q.get()
                if item is None:          # the broadcast failed: end the stream uncommitted, the replica rejects it
                    return
                yield item

        async def one(target, q):
            t0 = time.perf_counter()
            try:
                async with self.channel(target) as ch:
                    reply = await rollout_pb2_grpc.RolloutStub(ch).UpdateWeights(
                        stream(q), metadata=self.metadata, timeout=self.collective_timeout + 30)
                return self._check(target, reply, plan.manifest.version, t0)
            except Exception as e:  # noqa: BLE001
                return PushOutcome(target, False, _error(e), time.perf_counter() - t0)

        calls = [asyncio.ensure_future(one(t, q)) for t, q in zip(group.members, queues)]
        try:
            await asyncio.to_thread(self._broadcast, plan, state, queues, loop)
        except Exception as e:  # noqa: BLE001 - a timed-out or failed collective: drop the group, fail every target
            log.warning("nccl weight group %s failed: %s; it is aborted and re-formed on the next push",
                        group.group_id, e)
            self._drop_group()
            for q in queues:
                q.put_nowait(None)
            outcomes = await asyncio.gather(*calls)
            return [o if not o.ok else PushOutcome(o.target, False, f"nccl: {e}", o.seconds) for o in outcomes]
        for q in queues:
            q.put_nowait(_COMMIT)
        return list(await asyncio.gather(*calls))

    async def push(self, state, version, targets, *, bucket_bytes=DEVICE_BUCKET_BYTES) -> list[PushOutcome]:
        t0 = time.perf_counter()
        try:
            device = _device_of(state)
            plan = DevicePlan.build(state, version, _device_bucket_bytes(bucket_bytes))
        except Exception as e:  # noqa: BLE001
            return self._report(version, [PushOutcome(t, False, _error(e)) for t in targets])
        failed: dict[str, PushOutcome] = {}
        for t, err in (await self._reachable(targets)).items():
            failed[t] = PushOutcome(t, False, f"unreachable, left out of the nccl group: {err}")
        live = [t for t in targets if t not in failed]
        results: dict[str, PushOutcome] = {}
        # One retry: a replica that died mid-sync fails the group for everyone, the others get a re-formed one.
        for attempt in range(2):
            if not live:
                break
            if self.group is None or self.group.members != tuple(live) or self.group.device != device:
                errors = await self._form(live, device)
                if errors:
                    for t, err in errors.items():
                        results[t] = PushOutcome(t, False, err, time.perf_counter() - t0)
                    break
            outcomes = await self._push_group(state, plan)
            results.update({o.target: o for o in outcomes})
            if all(o.ok for o in outcomes):
                break
            self._drop_group()          # any failure: replicas may have left the group; the next one is fresh
            if attempt == 1:
                break
            dead = await self._reachable([o.target for o in outcomes if not o.ok])
            if not dead:
                break
            for t, err in dead.items():
                failed[t] = PushOutcome(t, False, f"{results[t].error} (now unreachable: {err})",
                                        time.perf_counter() - t0)
            live = [t for t in live if t not in dead]
        results.update(failed)
        if any(not o.ok for o in results.values()):
            self._drop_group()          # whoever failed may have left the group: the next push forms a fresh one
        return self._report(version, [results[t] for t in targets])

    def close(self) -> None:
        self._drop_group()
        self._buffers = []


def _nccl_importable() -> bool:
    try:
        import cupy.cuda.nccl  # noqa: F401
        return True
    except Exception:  # noqa: BLE001 - no CuPy or no NCCL: nccl is not picked
        return False


SENDERS = {"grpc": GrpcSender, "ipc": IpcSender, "nccl": NcclSender}
