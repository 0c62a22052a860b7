"""The ipc transport: replicas on the trainer's GPU copy the weights straight from its staging buffers, whose CUDA
IPC handles travel over `Rollout.UpdateWeights` (services/trainer/weights/senders.py)."""

from __future__ import annotations

import asyncio
import uuid

import torch

from meshrl.v1 import common_pb2, rollout_pb2_grpc
from services.common.tensors.device_staging import DeviceStaging
from services.common.tensors.in_process import share_in_process
from services.common.tensors.weight_transport import DevicePlan, device_uuid
from services.trainer.weights.senders import (COMMIT, DEVICE_BUCKET_BYTES, NO_TAGS, ManifestMessage, ManifestTags,
                                              PushOutcome, RpcSender, device_bucket_bytes, device_of, error_text)


class IpcSender(RpcSender):
    """CUDA IPC: replicas on the trainer's GPU copy the weights straight from its staging buffers.

    The staging buffers (one per bucket, the payload's size in all) are allocated once and shared once;
    a replica opens each handle once and keeps it open across updates.
    """

    transport = "ipc"
    on_device = True
    max_attempts = 1               # the sender's own retry (RpcSender.pushed)

    def __init__(self, *, token: str | None = None, timeout: float | None = 600.0):
        super().__init__(token=token, timeout=timeout)
        self._signature = None
        self._one_push = asyncio.Lock()
        self._buffers: list[torch.Tensor] = []
        self._handles: list[common_pb2.CudaIpcHandle] = []
        self._staging = DeviceStaging()            # the plan and the buffers' views, kept while the layout stays
        self._manifest = ManifestMessage()

    def _stage(self, state, version: int, bucket_bytes: int) -> tuple[DevicePlan, list[int]]:
        device = device_of(state)
        plan = self._staging.plan(state, version, bucket_bytes)
        with torch.cuda.device(device):
            signature = plan.signature()
            if signature != self._signature:
                self._buffers = [torch.empty(n, dtype=torch.uint8, device=device) for _, n, _ in plan.buckets]
                self._handles = [self._share(b, device) for b in self._buffers]
                self._signature = signature
            # One foreach copy into every bucket, one checksum per bucket, one host sync for them all.
            sums = self._staging.stage(list(state.values()), self._buffers)
            torch.cuda.current_stream(device).synchronize()    # the bytes are there before any handle is read
        return plan, sums

    @staticmethod
    def _share(buf: torch.Tensor, device: torch.device) -> common_pb2.CudaIpcHandle:
        from torch.multiprocessing.reductions import reduce_tensor

        # The same call torch.multiprocessing makes when it sends a CUDA tensor to another process.
        _, args = reduce_tensor(buf)
        buffer_id = uuid.uuid4().hex
        share_in_process(buffer_id, buf)                 # a replica in this very process reads it directly
        (_, _, _, _, _, _, _, handle, storage_bytes, storage_offset, _, rc_handle, rc_offset, ev_handle,
         ev_sync) = args
        return common_pb2.CudaIpcHandle(
            device_uuid=device_uuid(device), handle=handle, storage_bytes=storage_bytes,
            storage_offset=storage_offset, ref_counter_handle=rc_handle or b"", ref_counter_offset=rc_offset or 0,
            event_handle=ev_handle or b"", event_sync_required=bool(ev_sync), buffer_id=buffer_id)

    def _messages(self, plan: DevicePlan, sums: list[int], tags: ManifestTags):
        yield self._manifest(plan, "ipc", tags=tags)
        for (offset, nbytes, _), checksum, handle in zip(plan.buckets, sums, self._handles):
            yield common_pb2.WeightBucket(device=common_pb2.DeviceBucket(offset=offset, nbytes=nbytes,
                                                                         checksum=checksum, ipc=handle))
        yield COMMIT

    async def _push_one(self, target: str, plan: DevicePlan, sums: list[int], tags: ManifestTags) -> PushOutcome:
        async def call(channel):
            return await rollout_pb2_grpc.RolloutStub(channel).UpdateWeights(
                _aiter(self._messages(plan, sums, tags)), metadata=self.metadata, timeout=self.timeout)
        # The staging buffers stay as they are until the push ends (_one_push): a stream sent again reads the same.
        return await self.pushed(target, plan.manifest.version, call)

    async def push(self, state, version, targets, *, bucket_bytes=DEVICE_BUCKET_BYTES,
                   tags: ManifestTags = NO_TAGS) -> list[PushOutcome]:
        # One push at a time: concurrent ones (several runs' adapters) would overwrite each other's staging
        # buffers before the replicas read them (a checksum mismatch at best).
        async with self._one_push:
            return await self._push(state, version, targets, bucket_bytes=bucket_bytes, tags=tags)

    async def _push(self, state, version, targets, *, bucket_bytes: int, tags: ManifestTags) -> list[PushOutcome]:
        try:
            plan, sums = await asyncio.to_thread(self._stage, state, version, device_bucket_bytes(bucket_bytes))
        except Exception as e:  # noqa: BLE001
            return self._report(version, [PushOutcome(t, False, f"ipc staging failed: {error_text(e)}") for t in targets])
        outcomes = await asyncio.gather(*(self._push_one(t, plan, sums, tags) for t in targets))
        return self._report(version, outcomes)

    def close(self) -> None:
        self._buffers, self._handles, self._signature = [], [], None
        self._staging.clear()


async def _aiter(items):
    for item in items:
        yield item
