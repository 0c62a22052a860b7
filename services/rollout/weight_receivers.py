"""Receivers of weight updates that land whole before the engine applies them: the device transports ("ipc",
"nccl") and adapters over "grpc" (HostReceiver); full weights over "grpc" stream into the engine's update_weights.

Each device receiver takes one update's manifest and its device-bucket descriptors, lands every byte in a
staging buffer on the replica's GPU, checks every bucket's checksum, and only then returns the
tensors (views of the staging buffer) for the engine to swap in whole. On any failure nothing was
applied and the old version stays. No gRPC here: the servicer converts the messages.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterable

import torch

from services.common.errors import FailedPrecondition
from services.common.tensors.in_process import in_process_buffer
from services.common.tensors.weight_transport import (Received, abort_communicator, device_checksum, device_uuid,
                                                      init_communicator, local_device_of, nccl_unique_id_from_bytes,
                                                      receive_host, tensors_from_flat, wait_stream_done)
from services.common.tensors.weights import Manifest, PayloadAssembler

log = logging.getLogger("meshrl.rollout")


@dataclass(frozen=True)
class IpcHandle:
    """A CUDA IPC handle of one of the sender's device buffers (see CudaIpcHandle in common.proto)."""

    device_uuid: str
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    buffer_id: str


@dataclass(frozen=True)
class DeviceBucketSpec:
    """One bucket of a device update: its place in the payload, its checksum, and (ipc) its buffer."""

    offset: int
    nbytes: int
    checksum: int
    ipc: IpcHandle | None = None


def _check_tiling(manifest: Manifest, buckets: list[DeviceBucketSpec]) -> None:
    pos = 0
    for i, b in enumerate(buckets):
        if b.offset != pos or b.nbytes <= 0:
            raise ValueError(f"bucket {i}: offset {b.offset} / nbytes {b.nbytes} do not continue the payload at "
                             f"{pos}")
        pos += b.nbytes
    if pos != manifest.total_bytes:
        raise ValueError(f"payload truncated: buckets cover {pos} of {manifest.total_bytes} bytes")


def _verify(staging: torch.Tensor, buckets: list[DeviceBucketSpec]) -> None:
    if not buckets:
        return
    sums = torch.stack([device_checksum(staging[b.offset:b.offset + b.nbytes]) for b in buckets]).tolist()
    for i, (b, got) in enumerate(zip(buckets, sums)):
        if got != b.checksum:
            raise ValueError(f"bucket {i}: checksum mismatch (corrupted or overwritten device buffer)")


def _cuda_device(device) -> torch.device:
    d = torch.device(device)
    if d.type != "cuda":
        raise FailedPrecondition(f"weight transports ipc and nccl need the replica on a CUDA device "
                                 f"(model.device is {str(device)!r}); use transport grpc")
    return torch.device("cuda", d.index if d.index is not None else torch.cuda.current_device())


class IpcReceiver:
    """Copies each bucket from the sender's shared device buffer into local staging; handles stay open."""

    transport = "ipc"

    def __init__(self, device):
        self.device = _cuda_device(device)
        self._open: dict[str, torch.Tensor] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="meshrl-ipc")

    def _source(self, h: IpcHandle) -> torch.Tensor:
        t = self._open.get(h.buffer_id)
        if t is None:
            t = in_process_buffer(h.buffer_id)          # the trainer runs in this process: its buffer itself
        if t is not None:
            self._open[h.buffer_id] = t
            return t
        index = local_device_of(h.device_uuid)
        if index is None:
            raise FailedPrecondition(f"ipc: this replica sees no GPU with uuid {h.device_uuid} (trainer and replica "
                                     "must share a GPU; use transport grpc or nccl)")
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        # The inverse of the sender's reduce_tensor: what torch.multiprocessing does on receipt.
        t = rebuild_cuda_tensor(torch.Tensor, (h.storage_bytes,), (1,), 0, torch.storage.TypedStorage, torch.uint8,
                                index, h.handle, h.storage_bytes, h.storage_offset, False, h.ref_counter_handle,
                                h.ref_counter_offset, h.event_handle, h.event_sync_required)
        self._open[h.buffer_id] = t
        return t

    def _copy(self, manifest: Manifest, buckets: list[DeviceBucketSpec]) -> dict[str, torch.Tensor]:
        with torch.cuda.device(self.device):
            staging = torch.empty(manifest.total_bytes, dtype=torch.uint8, device=self.device)
            for i, b in enumerate(buckets):
                if b.ipc is None:
                    raise ValueError(f"bucket {i}: an ipc update's bucket carries no CUDA IPC handle")
                src = self._source(b.ipc)
                if src.numel() < b.nbytes:
                    raise ValueError(f"bucket {i}: {b.nbytes} bytes, but its shared buffer holds {src.numel()}")
                staging[b.offset:b.offset + b.nbytes].copy_(src[:b.nbytes], non_blocking=True)
            _verify(staging, buckets)           # syncs: every byte was read from the sender before we answer
            live = {b.ipc.buffer_id for b in buckets}
            for stale in [k for k in self._open if k not in live]:
                del self._open[stale]           # the sender re-allocated its buffers: close the old handles
            return tensors_from_flat(staging, manifest)

    async def receive(self, manifest: Manifest, buckets: AsyncIterable[DeviceBucketSpec], *,
                      group_id: str = "") -> tuple[dict[str, torch.Tensor], int]:
        PayloadAssembler(manifest)                   # validates the manifest
        specs = [b async for b in buckets]
        _check_tiling(manifest, specs)
        loop = asyncio.get_running_loop()
        tensors = await loop.run_in_executor(self._pool, self._copy, manifest, specs)
        return tensors, manifest.total_bytes

    def close(self) -> None:
        self._open.clear()
        self._pool.shutdown(wait=False)


class NcclReceiver:
    """This replica's end of the trainer's NCCL weight group: joins it, then receives broadcast buckets."""

    transport = "nccl"

    def __init__(self, device):
        self.device = _cuda_device(device)
        self.group_id = ""
        self.comm = None
        self.timeout = 120.0
        # One thread owns every NCCL call and CUDA context of this receiver.
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="meshrl-nccl")
        self._lock = asyncio.Lock()

    async def join(self, group_id: str, unique_id: bytes, rank: int, world_size: int, timeout: float) -> str:
        if not group_id:
            raise ValueError("group_id: empty")
        if len(unique_id) != 128:
            raise ValueError(f"unique_id: an ncclUniqueId has 128 bytes, got {len(unique_id)}")
        if not 1 <= rank < world_size:
            raise ValueError(f"rank: must be in [1, world_size), got {rank} of {world_size}")
        if not timeout > 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout}")
        async with self._lock:
            self._drop()
            comm = await asyncio.to_thread(init_communicator, nccl_unique_id_from_bytes(unique_id), world_size, rank,
                                           self.device, timeout)
            self.group_id, self.comm, self.timeout = group_id, comm, timeout
        log.info("joined nccl weight group %s as rank %d of %d on %s", group_id, rank, world_size, self.device)
        return device_uuid(self.device)

    def _drop(self) -> None:
        if self.comm is not None:
            abort_communicator(self.comm)
        self.comm, self.group_id = None, ""

    def _post(self, staging: torch.Tensor, b: DeviceBucketSpec, stream: torch.cuda.Stream) -> None:
        from cupy.cuda import nccl
        import cupy

        with torch.cuda.device(self.device), cupy.cuda.Device(self.device.index):
            part = staging[b.offset:b.offset + b.nbytes]
            self.comm.broadcast(part.data_ptr(), part.data_ptr(), b.nbytes, nccl.NCCL_UINT8, 0, stream.cuda_stream)

    def _finish(self, staging, specs, stream, deadline: float, manifest: Manifest) -> dict[str, torch.Tensor]:
        with torch.cuda.device(self.device):
            done = torch.cuda.Event()
            done.record(stream)
            wait_stream_done(done, deadline, f"receiving {len(specs)} buckets")
            _verify(staging, specs)
            return tensors_from_flat(staging, manifest)

    async def receive(self, manifest: Manifest, buckets: AsyncIterable[DeviceBucketSpec], *,
                      group_id: str = "") -> tuple[dict[str, torch.Tensor], int]:
        async with self._lock:
            if self.comm is None or group_id != self.group_id:
                raise FailedPrecondition(f"nccl: this replica is not in weight group {group_id!r} (it is in "
                                         f"{self.group_id or 'none'}); the trainer forms a new group on its next push")
            PayloadAssembler(manifest)
            loop = asyncio.get_running_loop()
            deadline = time.monotonic() + self.timeout
            with torch.cuda.device(self.device):
                staging = torch.empty(manifest.total_bytes, dtype=torch.uint8, device=self.device)
                stream = torch.cuda.Stream(self.device)
            specs: list[DeviceBucketSpec] = []
            pos = 0
            try:
                async for b in buckets:
                    if b.offset != pos or b.nbytes <= 0 or pos + b.nbytes > manifest.total_bytes:
                        raise ValueError(f"bucket {len(specs)}: offset {b.offset} / nbytes {b.nbytes} do not continue "
                                         f"the payload at {pos}")
                    specs.append(b)
                    pos += b.nbytes
                    await loop.run_in_executor(self._pool, self._post, staging, b, stream)
                _check_tiling(manifest, specs)
                return await loop.run_in_executor(self._pool, self._finish, staging, specs, stream, deadline,
                                                  manifest), manifest.total_bytes
            except BaseException:
                # The group is out of step with the trainer (or hung): abort it; the trainer re-forms one.
                log.warning("nccl weight group %s aborted after a failed update; old weights kept", self.group_id)
                self._drop()
                raise

    def close(self) -> None:
        self._drop()
        self._pool.shutdown(wait=False)


class HostReceiver:
    """Transport grpc's receiver of adapter updates (small: received whole on the host, then loaded).

    The staging buffer is kept for the next update once one was applied: a new one costs its page faults on every
    push (about 20 ms for a 37 MB adapter on a CPU, more than loading it). On a CUDA replica it is pinned and the
    payload reaches the device in one copy, the tensors being views of it there (not one copy per tensor).
    """

    transport = "grpc"

    def __init__(self, device):
        self.device = torch.device(device)
        self._spare: torch.Tensor | None = None

    async def receive(self, manifest: Manifest, buckets: AsyncIterable[tuple[bytes, int]]) -> Received:
        """Every bucket, CRC-checked, staged in the kept buffer when it fits (taken meanwhile: a concurrent update
        stages in its own); the tensors on the replica's device."""
        spare, self._spare = self._spare, None
        received = await receive_host(manifest, buckets, buffer=spare, pin_memory=self.device.type == "cuda")
        if self.device.type == "cuda":      # off the event loop: the copy waits for the device
            received.tensors = await asyncio.to_thread(lambda: tensors_from_flat(received.buffer.to(self.device),
                                                                                 manifest))
        return received

    def keep(self, received: Received) -> None:
        """`received` was applied (the engine copied it out): its buffer stages the next update. An update that
        failed is not kept: a swap given up may still be reading it."""
        self._spare = received.buffer


RECEIVERS = {"ipc": IpcReceiver, "nccl": NcclReceiver}


class DeviceReceivers:
    """The receivers of one replica: the device ones made on first use (a CPU replica never makes one), and `host`,
    transport grpc's for adapters."""

    def __init__(self, device):
        self.device = device
        self.host = HostReceiver(device)
        self._made: dict[str, object] = {}

    def get(self, transport: str):
        if transport not in RECEIVERS:
            raise ValueError(f"manifest.transport: unknown transport {transport!r} (expected grpc, ipc or nccl)")
        if transport not in self._made:
            self._made[transport] = RECEIVERS[transport](self.device)
        return self._made[transport]

    def available(self) -> list[str]:
        out = ["grpc"]
        if str(self.device).startswith("cuda"):
            out.append("ipc")
            try:
                import cupy.cuda.nccl  # noqa: F401
                out.append("nccl")
            except Exception:  # noqa: BLE001 - no CuPy / no NCCL: transport nccl is not offered
                pass
        return out

    def close(self) -> None:
        for r in self._made.values():
            r.close()
        self._made.clear()
