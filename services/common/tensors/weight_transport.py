"""Weight-update transport pieces shared by trainer senders and rollout receivers (no gRPC here).

The "grpc" stream carries `WeightBucket` messages; the payload buckets make up nearly every byte, so
they skip protobuf both ways: `HostPayload` cuts a state dict into memoryview slices, computes each
bucket's CRC once per update (off the event loop, ahead of the stream) and encodes a bucket message
with one copy; `decode_bucket` reads a bucket message as a memoryview of the received bytes; and
`HostStaging` checks and copies buckets into one preallocated buffer off the event loop, whose
slices become the update's tensors. The device transports ("ipc", "nccl") share `DevicePlan`, the
payload cut into fixed-size buckets (packed on the device: services/common/tensors/device_staging.py), and
`device_checksum`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import torch

try:                        # ISA-L's CRC-32 (zlib's polynomial, same values) runs ~6x faster than zlib's here
    if os.environ.get("MESHRL_WEIGHT_CRC32") == "zlib":      # benchmarks measure the fallback with this
        raise ImportError
    from isal.isal_zlib import crc32 as _crc32
    CRC32_IMPL = "isal"
except ImportError:         # pragma: no cover - depends on the environment
    from zlib import crc32 as _crc32
    CRC32_IMPL = "zlib"

from services.common.tensors.codec import DTYPES, dtype_from_name, tensor_bytes
from services.common.tensors.weights import Manifest, PayloadAssembler, build_manifest, view_plan

# WeightBucket field tags: manifest = 1 (bytes), data = 2 (bytes), crc32 = 3 (varint), device = 4 (bytes),
# commit = 5 (varint).
_TAG_DATA, _TAG_CRC = 0x12, 0x18
# The last message of every update stream: WeightBucket(commit=True).
COMMIT_MESSAGE = bytes([0x28, 0x01])


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def encode_bucket(parts: Sequence[memoryview], crc32: int) -> bytes:
    """The wire bytes of WeightBucket(data=b"".join(parts), crc32=crc32): one copy of the payload slice."""
    nbytes = sum(len(p) for p in parts)
    return b"".join([bytes([_TAG_CRC]), _varint(crc32), bytes([_TAG_DATA]), _varint(nbytes), *parts])


@dataclass(frozen=True)
class DataBucket:
    """A payload bucket as received: `data` is a view of the message bytes (no copy)."""

    data: memoryview
    crc32: int
    commit = False

    def HasField(self, name: str) -> bool:  # noqa: N802 - quacks like the WeightBucket it stands for
        return False


def decode_bucket(raw: bytes):
    """Parses a WeightBucket message; payload buckets come back as a DataBucket without copying the data.

    Anything else (the manifest, device buckets, unexpected fields) is parsed by protobuf.
    """
    from meshrl.v1 import common_pb2

    view = memoryview(raw)
    pos, data, crc = 0, None, 0
    try:
        while pos < len(view):
            tag = view[pos]
            if tag == _TAG_CRC:
                crc, pos = _read_varint(view, pos + 1)
            elif tag == _TAG_DATA:
                n, pos = _read_varint(view, pos + 1)
                if pos + n > len(view):
                    raise ValueError("truncated data")
                data, pos = view[pos:pos + n], pos + n
            else:
                return common_pb2.WeightBucket.FromString(raw)
    except ValueError:
        return common_pb2.WeightBucket.FromString(raw)      # raises DecodeError on bytes that do not parse
    if crc > 0xFFFFFFFF:
        return common_pb2.WeightBucket.FromString(raw)
    return DataBucket(data if data is not None else view[0:0], crc)


# --------------------------------------------------------------------------------------------------
# Host payloads (transport grpc)


def _crc_parts(parts: Sequence[memoryview]) -> int:
    crc = 0
    for p in parts:
        crc = _crc32(p, crc)
    return crc


class HostPayload:
    """One update's payload for the "grpc" stream, shared by every target of a push.

    Buckets are memoryview slices of the (contiguous, CPU) state tensors, cut exactly as
    `weights.iter_buckets` cuts them; CRCs are computed once, in order, by one worker thread that
    runs ahead of the streams, so N targets cost one checksum pass, not N.
    """

    def __init__(self, state: Mapping[str, torch.Tensor], version: int, bucket_bytes: int):
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes: must be positive, got {bucket_bytes}")
        self.manifest = build_manifest(state, version)
        self._views = [tensor_bytes(t) for t in state.values()]   # keep the tensors' memory alive
        self.buckets: list[list[memoryview]] = []
        cur, used = [], 0
        for view in self._views:
            start = 0
            while start < len(view):
                take = min(bucket_bytes - used, len(view) - start)
                cur.append(view[start:start + take])
                used += take
                start += take
                if used == bucket_bytes:
                    self.buckets.append(cur)
                    cur, used = [], 0
        if cur:
            self.buckets.append(cur)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._crcs: list[concurrent.futures.Future] | None = None

    @property
    def num_bytes(self) -> int:
        return self.manifest.total_bytes

    def start(self) -> None:
        """Queues every bucket's CRC on the worker thread (idempotent)."""
        if self._crcs is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="meshrl-crc")
            self._crcs = [self._pool.submit(_crc_parts, parts) for parts in self.buckets]

    async def crc(self, i: int) -> int:
        self.start()
        return await asyncio.wrap_future(self._crcs[i])

    async def messages(self, manifest_message: bytes):
        """Wire bytes of the whole stream: the serialized manifest message, every bucket, the commit."""
        yield manifest_message
        for i, parts in enumerate(self.buckets):
            yield encode_bucket(parts, await self.crc(i))
        yield COMMIT_MESSAGE

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def tensors_from_flat(flat: torch.Tensor, manifest: Manifest) -> dict[str, torch.Tensor]:
    """The manifest's tensors as views of a flat uint8 buffer (a copy only where an offset is misaligned).

    One strided view of the buffer's words per tensor, from a plan made once per layout (view_plan: an adapter has
    hundreds of small tensors, and slicing and re-viewing each costs three torch calls, reading its spec more)."""
    end, plan = view_plan(manifest.tensors)
    if end > flat.numel():
        raise ValueError(f"payload truncated: the manifest's tensors reach past its {flat.numel()} bytes")
    out = {}
    words: dict[torch.dtype, torch.Tensor | None] = {}    # the buffer as each dtype's words (None: misaligned)
    for name, dtype_name, shape, strides, offset, nbytes in plan:
        dtype = DTYPES.get(dtype_name) or dtype_from_name(dtype_name, field=name)
        if dtype not in words:
            size = dtype.itemsize
            words[dtype] = None if flat.numel() % size or flat.storage_offset() % size else flat.view(dtype)
        typed = words[dtype]
        if not nbytes:
            out[name] = torch.empty(shape, dtype=dtype, device=flat.device)
        elif typed is None or offset % dtype.itemsize:
            out[name] = flat[offset:offset + nbytes].clone().view(dtype).view(shape)
        else:                             # as_strided's offset counts from the storage's start, not the view's
            out[name] = typed.as_strided(shape, strides, typed.storage_offset() + offset // dtype.itemsize)
    return out


def _check_and_copy(dst, data: memoryview, crc: int, index: int) -> None:
    if _crc32(data) != crc:
        raise ValueError(f"bucket {index}: checksum mismatch (corrupted payload)")
    import numpy as np

    np.copyto(dst, np.frombuffer(data, dtype=np.uint8))    # releases the GIL; data stays a view


class HostStaging:
    """Receives one update's buckets into a preallocated CPU buffer, checking each CRC off the event loop.

    The manifest is validated first (as PayloadAssembler does); `finish()` waits for the pending
    checks and returns the tensors as views of the buffer. Nothing reaches a model before then.
    """

    MAX_PENDING = 8     # buckets checked ahead of the stream before add() waits (bounds memory held)

    def __init__(self, manifest: Manifest, buffer: torch.Tensor | None = None, *, pin_memory: bool = False):
        PayloadAssembler(manifest)           # validates names, dtypes, shapes, offsets and total_bytes
        self.manifest = manifest
        # A buffer of the right size from an earlier update is reused: its pages are already mapped. A new one is
        # pinned on request (a CUDA replica copies it to the device whole).
        reuse = buffer is not None and buffer.dtype == torch.uint8 and buffer.device.type == "cpu" \
            and buffer.numel() == manifest.total_bytes and buffer.is_contiguous()
        self.buffer = buffer if reuse else torch.empty(manifest.total_bytes, dtype=torch.uint8, pin_memory=pin_memory)
        self._np = self.buffer.numpy()
        self.num_bytes = 0
        self.num_buckets = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="meshrl-recv")
        self._pending: list[asyncio.Future] = []

    async def add(self, data, crc32: int) -> None:
        n = len(data)
        if self.num_bytes + n > self.manifest.total_bytes:
            raise ValueError(f"bucket {self.num_buckets}: payload longer than manifest.total_bytes "
                             f"({self.manifest.total_bytes})")
        view = data if isinstance(data, memoryview) else memoryview(data)
        dst = self._np[self.num_bytes:self.num_bytes + n]
        loop = asyncio.get_running_loop()
        self._pending.append(loop.run_in_executor(self._pool, _check_and_copy, dst, view, crc32, self.num_buckets))
        self.num_bytes += n
        self.num_buckets += 1
        if len(self._pending) >= self.MAX_PENDING:
            await self._pending.pop(0)

    async def finish(self) -> dict[str, torch.Tensor]:
        await self._drain()
        if self.num_bytes != self.manifest.total_bytes:
            raise ValueError(f"payload truncated: got {self.num_bytes} of {self.manifest.total_bytes} bytes")
        return tensors_from_flat(self.buffer, self.manifest)

    async def _drain(self) -> None:
        pending, self._pending = self._pending, []
        try:
            for f in pending:
                await f
        finally:
            for f in pending:
                f.cancel()

    async def close(self) -> None:
        """Waits for the worker (so no copy runs into a freed buffer) and stops it."""
        for f in self._pending:
            try:
                await f
            except Exception:  # noqa: BLE001 - the first error was already raised to the caller
                pass
        self._pending = []
        self._pool.shutdown(wait=True)


@dataclass
class Received:
    """One update that arrived whole and checked out: its tensors are views of `buffer` (or of its copy on a
    replica's device: HostReceiver)."""

    tensors: dict[str, torch.Tensor]
    num_bytes: int
    buffer: torch.Tensor


async def receive_host(manifest: Manifest, buckets, *, buffer: torch.Tensor | None = None,
                       pin_memory: bool = False) -> Received:
    """Every bucket of a grpc update, checked and staged in one buffer (`buffer` when it fits, else a new one,
    pinned when asked)."""
    staging = HostStaging(manifest, buffer, pin_memory=pin_memory)
    try:
        async for data, crc in buckets:
            await staging.add(data, crc)
        return Received(await staging.finish(), staging.num_bytes, staging.buffer)
    finally:
        await staging.close()


# --------------------------------------------------------------------------------------------------
# Device payloads (transports ipc and nccl)


def device_checksum(flat: torch.Tensor) -> torch.Tensor:
    """Exact int64 checksum of a flat uint8 buffer: its bytes as int32 (uint8 if nbytes % 4) summed.

    Order-independent integer math, so sender and receiver agree bit for bit on any device.
    """
    if flat.numel() % 4 == 0 and flat.storage_offset() % 4 == 0:
        return flat.view(torch.int32).sum(dtype=torch.int64)
    return flat.sum(dtype=torch.int64)


@dataclass(frozen=True)
class DevicePlan:
    """The payload cut into buckets of at most bucket_bytes; each bucket lists the tensor byte ranges in it."""

    manifest: Manifest
    bucket_bytes: int
    # per bucket: (payload offset, nbytes, [(tensor index, start byte in tensor, nbytes, byte in bucket)])
    buckets: tuple[tuple[int, int, tuple[tuple[int, int, int, int], ...]], ...]

    @classmethod
    def build(cls, state: Mapping[str, torch.Tensor], version: int, bucket_bytes: int) -> "DevicePlan":
        if bucket_bytes <= 0 or bucket_bytes % 4:
            raise ValueError(f"bucket_bytes: must be a positive multiple of 4, got {bucket_bytes}")
        manifest = build_manifest(state, version)
        buckets = []
        for start in range(0, manifest.total_bytes, bucket_bytes):
            end = min(start + bucket_bytes, manifest.total_bytes)
            pieces = []
            for i, m in enumerate(manifest.tensors):
                lo, hi = max(start, m.offset), min(end, m.offset + m.nbytes)
                if lo < hi:
                    pieces.append((i, lo - m.offset, hi - lo, lo - start))
            buckets.append((start, end - start, tuple(pieces)))
        return cls(manifest, bucket_bytes, tuple(buckets))

    def signature(self) -> tuple:
        """What must match for staging buffers to be reused across updates: layout, not version."""
        return (self.bucket_bytes, tuple((m.name, m.dtype, m.shape) for m in self.manifest.tensors))


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as a flat uint8 view (no copy when it is contiguous already)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def device_uuid(device: torch.device | int | str) -> str:
    """The UUID of a CUDA device: the name two processes with different CUDA_VISIBLE_DEVICES agree on."""
    return str(torch.cuda.get_device_properties(torch.device(device)).uuid)


def host_id() -> str:
    """This machine's boot id: processes (and containers) on one host agree on it, two hosts never do."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()


def placement_of(device) -> dict[str, str]:
    """Where a process's weights live, as GetInfo reports it: the host, and the CUDA device's UUID when on one
    (weight_sync.transport auto compares them with the trainer's)."""
    out = {"host_id": host_id()}
    if str(device).startswith("cuda") and torch.cuda.is_available():
        d = torch.device(device)
        out["device_uuid"] = device_uuid(d if d.index is not None else torch.device("cuda", torch.cuda.current_device()))
    return out


def local_device_of(uuid: str) -> int | None:
    """This process's index of the CUDA device with that UUID, or None."""
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    return None


# --------------------------------------------------------------------------------------------------
# NCCL (CuPy) helpers of transport nccl, shared by the trainer's sender and the replicas' receivers


def nccl_unique_id_bytes(uid) -> bytes:
    """cupy's ncclUniqueId (a tuple of 128 signed chars) as raw bytes, and back."""
    return bytes(int(b) & 0xFF for b in uid)


def nccl_unique_id_from_bytes(data: bytes) -> tuple:
    return tuple(b - 256 if b > 127 else b for b in data)


def wait_stream_done(event: torch.cuda.Event, deadline: float, what: str) -> None:
    """Polls a CUDA event until it completes or the deadline passes (a hung collective never blocks forever)."""
    while not event.query():
        if time.monotonic() > deadline:
            raise TimeoutError(f"nccl: {what} did not complete before the deadline")
        time.sleep(0.0005)


def init_communicator(unique_id: tuple, world_size: int, rank: int, device: torch.device, timeout: float):
    """ncclCommInitRank in a helper thread with a deadline; on timeout the thread is left behind (NCCL has no
    way to abort an init that waits for missing members) and TimeoutError names the group size."""
    from cupy.cuda import nccl
    import cupy

    box: dict = {}

    def run():
        try:
            with cupy.cuda.Device(device.index):
                box["comm"] = nccl.NcclCommunicator(world_size, unique_id, rank)
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    thread = threading.Thread(target=run, name="meshrl-nccl-init", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"nccl: not every member of the {world_size}-member weight group joined within "
                           f"{timeout:.0f}s")
    if "error" in box:
        raise RuntimeError(f"nccl: communicator init failed: {box['error']}")
    return box["comm"]


def abort_communicator(comm) -> None:
    try:
        comm.abort()
    except Exception:  # noqa: BLE001 - best effort: the group is dropped either way
        pass
