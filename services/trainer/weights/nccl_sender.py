"""The nccl transport: trainer rank 0 and every replica's GPU form one NCCL communicator (CuPy's `cupy.cuda.nccl`;
the unique id travels over `Rollout.JoinWeightGroup`) and each bucket is broadcast while the next one packs; every
collective has a deadline (services/trainer/weights/senders.py)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Sequence

import torch

from meshrl.v1 import common_pb2, rollout_pb2_grpc
from services.common.tensors.device_staging import DeviceStaging
from services.common.tensors.weight_transport import (DevicePlan, abort_communicator, device_checksum,
                                                      init_communicator, nccl_unique_id_bytes, wait_stream_done)
from services.trainer.weights.senders import (COMMIT, DEVICE_BUCKET_BYTES, NO_TAGS, ManifestMessage, ManifestTags,
                                              PushOutcome, RpcSender, device_bucket_bytes, device_of, error_text)

log = logging.getLogger("meshrl.trainer")


@dataclass
class _Group:
    members: tuple[str, ...]
    group_id: str
    comm: object
    device: torch.device


class NcclSender(RpcSender):
    """NCCL broadcast from trainer rank 0 to every replica's GPU; groups re-form when the targets change."""

    transport = "nccl"
    on_device = True

    def __init__(self, *, token: str | None = None, timeout: float | None = 600.0,
                 collective_timeout: float = 120.0):
        super().__init__(token=token, timeout=timeout)
        self.collective_timeout = collective_timeout
        self._one_push = asyncio.Lock()
        self.group: _Group | None = None
        self._buffers: list[torch.Tensor] = []
        self._staging = DeviceStaging()            # the plan and the buffers' views, kept while the layout stays
        self._manifest = ManifestMessage()

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
                return t, error_text(e)
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
                return target, error_text(e)

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
            tensors = list(state.values())
            done: list[torch.cuda.Event | None] = [None, None]
            for k, (offset, nbytes, _) in enumerate(plan.buckets):
                buf = self._buffers[k % 2]
                if done[k % 2] is not None:                   # bucket k-2 left this buffer
                    wait_stream_done(done[k % 2], deadline, f"broadcast of bucket {k - 2}")
                with torch.cuda.stream(pack_stream):
                    self._staging.pack(tensors, self._buffers, (k,))       # bucket k goes to buffer k % 2
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

    async def _push_group(self, state, plan: DevicePlan, tags: ManifestTags) -> list[PushOutcome]:
        group = self.group
        loop = asyncio.get_running_loop()
        queues = [asyncio.Queue() for _ in group.members]
        manifest = self._manifest(plan, "nccl", group.group_id, tags)

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
                return PushOutcome(target, False, error_text(e), time.perf_counter() - t0)

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
            q.put_nowait(COMMIT)
        return list(await asyncio.gather(*calls))

    async def push(self, state, version, targets, *, bucket_bytes=DEVICE_BUCKET_BYTES,
                   tags: ManifestTags = NO_TAGS) -> list[PushOutcome]:
        # One push at a time: concurrent ones (several runs' adapters) would overwrite each other's staging
        # buffers before the replicas read them (a checksum mismatch at best).
        async with self._one_push:
            return await self._push(state, version, targets, bucket_bytes=bucket_bytes, tags=tags)

    async def _push(self, state, version, targets, *, bucket_bytes: int, tags: ManifestTags) -> list[PushOutcome]:
        t0 = time.perf_counter()
        try:
            device = device_of(state)
            plan = self._staging.plan(state, version, device_bucket_bytes(bucket_bytes))
        except Exception as e:  # noqa: BLE001
            return self._report(version, [PushOutcome(t, False, error_text(e)) for t in targets])
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
            outcomes = await self._push_group(state, plan, tags)
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
        self._staging.clear()


def nccl_importable() -> bool:
    try:
        import cupy.cuda.nccl  # noqa: F401
        return True
    except Exception:  # noqa: BLE001 - no CuPy or no NCCL: nccl is not picked
        return False
