"""Which sender pushes the trainer's weights: `SENDERS` (transport name -> sender class), `build_sender` for
`weight_sync.transport`, and `AutoSender` for its `auto`, which picks each replica's transport from where the
replica says it is (services/common/placement.py). The transports themselves are services/trainer/weights/
(senders.py: the interface and what they share; grpc_sender.py, ipc_sender.py, nccl_sender.py)."""

from __future__ import annotations

import asyncio
import logging
from typing import Sequence

import torch

from meshrl.v1 import common_pb2, rollout_pb2_grpc
from services.common.manifest import DEFAULT_BUCKET_BYTES
from services.common.placement import Placement, pick_transport, placement_from
from services.trainer.weights.grpc_sender import GrpcSender
from services.trainer.weights.ipc_sender import IpcSender
from services.trainer.weights.nccl_sender import NcclSender, nccl_importable
from services.trainer.weights.senders import (DEVICE_BUCKET_BYTES, NO_TAGS, ManifestTags, PushOutcome, RpcSender,
                                              WeightSender, error_text)

log = logging.getLogger("meshrl.trainer")

SENDERS = {"grpc": GrpcSender, "ipc": IpcSender, "nccl": NcclSender}


class AutoSender(RpcSender):
    """weight_sync.transport auto: each replica gets the fastest transport that reaches it (pick_transport),
    from its GetInfo, asked once per replica address and again after a failed push (a restarted replica may sit
    elsewhere). Replicas of one push may differ: each transport's share is pushed concurrently."""

    transport = "auto"

    def __init__(self, trainer: Placement, *, token: str | None = None, timeout: float | None = 600.0,
                 collective_timeout: float = 120.0, on_choice=None, grpc_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 device_bucket_bytes: int = DEVICE_BUCKET_BYTES):
        super().__init__(token=token, timeout=timeout)
        self.trainer = trainer
        self.bucket_defaults = {"grpc": grpc_bucket_bytes, "ipc": device_bucket_bytes, "nccl": device_bucket_bytes}
        self.collective_timeout = collective_timeout
        self.chosen: dict[str, tuple[str, str]] = {}        # target -> (transport, why)
        self._senders: dict[str, WeightSender] = {}
        self._nccl = None
        self._planned: tuple[tuple[str, ...], dict[str, str]] | None = None     # prepare()'s, for the next push
        # on_choice(target, transport, why): told each new choice (the trainer records it for GetInfo).
        self.on_choice = on_choice
        self.on_device = False

    def _sender(self, transport: str) -> WeightSender:
        if transport not in self._senders:
            self._senders[transport] = build_sender(transport, token=self.token, timeout=self.timeout,
                                                    collective_timeout=self.collective_timeout)
        return self._senders[transport]

    async def _placement_of(self, target: str) -> Placement:
        async with self.channel(target) as ch:
            info = await rollout_pb2_grpc.RolloutStub(ch).GetInfo(common_pb2.GetInfoRequest(), metadata=self.metadata,
                                                                   timeout=10.0)
        return placement_from(info.details)

    async def prepare(self, targets: Sequence[str]) -> dict[str, str]:
        """The transport of each target for the next push (asking GetInfo of those not chosen yet, once); sets
        on_device (a device transport is used). A target whose GetInfo failed takes grpc for this push only."""
        if self._nccl is None:
            self._nccl = bool(self.trainer.device_uuid) and nccl_importable()

        async def choose(t):
            try:
                transport, why = pick_transport(self.trainer, await self._placement_of(t), nccl_here=self._nccl)
            except Exception as e:  # noqa: BLE001 - unreachable now: grpc this time, asked again next push
                return t, ("grpc", f"GetInfo failed ({error_text(e)}); asked again at the next push"), False
            return t, (transport, why), True

        plan = {t: self.chosen[t][0] for t in targets if t in self.chosen}
        for t, choice, keep in await asyncio.gather(*(choose(t) for t in targets if t not in self.chosen)):
            plan[t] = choice[0]
            if keep:
                self.chosen[t] = choice
                log.info("weight_sync.transport auto -> %s for %s (%s)", choice[0], t, choice[1])
            if self.on_choice is not None:
                self.on_choice(t, *choice)
        self._planned = (tuple(targets), plan)
        self.on_device = any(transport != "grpc" for transport in plan.values())
        return plan

    async def push(self, state, version, targets, *, bucket_bytes: int = 0,
                   tags: ManifestTags = NO_TAGS) -> list[PushOutcome]:
        """bucket_bytes: every transport's bucket size (0: each transport's own default). Follows the plan of the
        prepare() call for these targets (made here when there was none)."""
        if self._planned is None or self._planned[0] != tuple(targets):
            await self.prepare(targets)
        plan, self._planned = self._planned[1], None        # a plan serves one push
        by: dict[str, list[str]] = {}
        for t in targets:
            by.setdefault(plan[t], []).append(t)
        host_state = None
        if "grpc" in by and any(v.device.type != "cpu" for v in state.values()):
            host_state = await asyncio.to_thread(lambda: {k: v.to("cpu") for k, v in state.items()})

        async def one(transport: str, group: list[str]):
            sender = self._sender(transport)
            size = bucket_bytes or self.bucket_defaults[transport]
            return await sender.push(host_state if transport == "grpc" and host_state is not None else state,
                                     version, group, bucket_bytes=size, tags=tags)

        results = {o.target: o for outs in await asyncio.gather(*(one(tr, g) for tr, g in by.items())) for o in outs}
        for t, o in results.items():
            if not o.ok:
                self.chosen.pop(t, None)          # asked again at the next push
        return [results[t] for t in targets]

    def close(self) -> None:
        for sender in self._senders.values():
            sender.close()
        self._senders.clear()


def available_senders(device) -> list[str]:
    """The transports this trainer can send over (GetInfo's weight_transports)."""
    if torch.device(device).type != "cuda":
        return ["grpc"]
    return ["grpc", "ipc"] + (["nccl"] if nccl_importable() else [])


def check_transport(transport: str, device: torch.device) -> None:
    """Refuses, before the trainer serves, an explicit transport that cannot work here."""
    if transport in ("ipc", "nccl") and torch.device(device).type != "cuda":
        raise ValueError(f"weight_sync.transport: {transport} needs the trainer on a CUDA device (model.device is "
                         f"{str(device)!r}); set it to auto or grpc")
    if transport == "nccl" and not nccl_importable():
        raise ValueError("weight_sync.transport: nccl needs CuPy with NCCL (pip install cupy-cuda12x), which does "
                         "not import here; set it to auto, ipc or grpc")


def build_sender(transport: str, *, token: str | None, timeout: float | None,
                 collective_timeout: float = 120.0, **auto) -> WeightSender:
    """The sender `weight_sync.transport` names; `auto` takes AutoSender's keywords (the trainer's placement)."""
    if transport == "auto":
        return AutoSender(auto.pop("trainer", Placement()), token=token, timeout=timeout,
                          collective_timeout=collective_timeout, **auto)
    if transport not in SENDERS:
        raise ValueError(f"weight_sync.transport: unknown transport {transport!r} (expected auto or one of "
                         f"{sorted(SENDERS)})")
    if transport == "nccl":
        return NcclSender(token=token, timeout=timeout, collective_timeout=collective_timeout)
    return SENDERS[transport](token=token, timeout=timeout)
