"""Adapter-only weight sync under actor.lora: a replica whose engine serves adapters gets the adapter's tensors
(PEFT's saved names, its config in the manifest) on every push, over whichever transport reaches it; one that holds
another base gets the frozen base once first; one whose engine serves no adapters gets the merged weights as before.

What each replica can take is read from its GetInfo (supports_adapters, base_id: services/common/base_identity.py),
once per address and again after a failed push. Every push keeps the version and all-or-nothing rules of full
weights: the replica applies an adapter whole (RolloutEngine.load_adapter) or keeps the old one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Sequence

from meshrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.common.base_identity import base_id
from services.trainer.model.lora import ADAPTER, adapter_sync_config
from services.trainer.weights.choice import AutoSender
from services.trainer.weights.senders import ManifestTags, PushOutcome, RpcSender, error_text

log = logging.getLogger("meshrl.trainer")


@dataclass
class ReplicaView:
    """What one replica can take: whether its engine serves adapters, and the base it holds."""

    supports_adapters: bool
    base_id: str


@dataclass
class SyncResult:
    """One PushWeights under actor.lora: per-target outcomes, what reached each, and the payload bytes sent."""

    outcomes: list[PushOutcome]
    payload: dict[str, str] = field(default_factory=dict)       # target -> full | adapter | base+adapter
    adapter: dict[str, str] = field(default_factory=dict)       # target -> adapter name it serves ("" = merged)
    num_bytes: int = 0


class AdapterSync:
    """Splits each push of a LoRA run by what its replicas can take (module docstring)."""

    def __init__(self, engine, sender, *, token: str | None, timeout: float | None, adapter_name: str = ADAPTER):
        self.engine = engine
        self.sender = sender
        self.name = adapter_name
        rank = engine.rank
        # A base with no readable folder has no digest: the first push then gives every replica the base, under an
        # id only this trainer knows.
        self.base_id = base_id(rank.model_path) or f"trainer:{uuid.uuid4().hex}"
        self.config = json.dumps(adapter_sync_config(rank.cfg.lora), sort_keys=True)
        self.views: dict[str, ReplicaView] = {}
        # adapter name -> replicas that took it (UnloadAdapter goes to these when the trainer deletes it)
        self.served: dict[str, set[str]] = {}
        self._rpc = RpcSender(token=token, timeout=timeout)

    async def _view(self, target: str) -> ReplicaView | None:
        if target in self.views:
            return self.views[target]
        try:
            async with self._rpc.channel(target) as ch:
                info = await rollout_pb2_grpc.RolloutStub(ch).GetInfo(common_pb2.GetInfoRequest(),
                                                                       metadata=self._rpc.metadata, timeout=10.0)
        except Exception as e:  # noqa: BLE001 - merged weights this time; asked again at the next push
            log.warning("weight_sync: GetInfo of %s failed (%s); merged weights this push", target, error_text(e))
            return None
        view = ReplicaView(info.details.get("supports_adapters") == "true", info.details.get("base_id", ""))
        self.views[target] = view
        self.engine.rank.resolved.record(
            f"weight_sync.payload[{target}]", "adapter" if view.supports_adapters else "full", "auto",
            "its engine serves LoRA adapters: the adapter alone" if view.supports_adapters else
            "its engine serves no LoRA adapters: merged full weights")
        return view

    async def _push(self, targets: list[str], kind: str, tags: ManifestTags, bucket_bytes: int,
                    result: SyncResult, named: str = "") -> list[PushOutcome]:
        if isinstance(self.sender, AutoSender):
            await self.sender.prepare(targets)
        state, version = await asyncio.to_thread(self.engine.state_for_sync, self.sender.on_device, kind, named)
        result.num_bytes += sum(t.numel() * t.element_size() for t in state.values())
        outcomes = await self.sender.push(state, version, targets, bucket_bytes=bucket_bytes, tags=tags)
        for o in outcomes:
            if not o.ok:
                self.views.pop(o.target, None)          # asked again at the next push
        return outcomes

    async def push(self, targets: Sequence[str], bucket_bytes: int, named: str = "") -> SyncResult:
        """Merged weights to replicas that serve no adapters, the base once to those on another base, then the
        adapter to every replica that serves adapters. `named` (a named adapter, model/adapter_set.py): that
        adapter alone, under its name; a replica that serves no adapters gets the base with that adapter merged in."""
        views = dict(zip(targets, await asyncio.gather(*(self._view(t) for t in targets))))
        full = [t for t in targets if views[t] is None or not views[t].supports_adapters]
        lora = [t for t in targets if t not in full]
        needs_base = [t for t in lora if views[t].base_id != self.base_id]
        result = SyncResult([])
        done: dict[str, PushOutcome] = {}
        if full:
            done.update({o.target: o for o in await self._push(full, "full", ManifestTags(base_id=""), bucket_bytes,
                                                                result, named)})
            result.payload.update({t: "full" for t in full})
        if needs_base:
            log.info("weight_sync: %s hold another base than %s: pushing the frozen base once", needs_base,
                     self.base_id)
            for o in await self._push(needs_base, "base", ManifestTags(base_id=self.base_id), bucket_bytes, result):
                if o.ok:
                    views[o.target].base_id = self.base_id
                else:
                    done[o.target] = o
        adapters = [t for t in lora if t not in done]
        if adapters:
            t0 = time.perf_counter()
            name = named or self.name
            tags = ManifestTags(adapter=name, adapter_config=self.config, base_id=self.base_id)
            for o in await self._push(adapters, "adapter", tags, bucket_bytes, result, named):
                done[o.target] = o
                result.payload[o.target] = "base+adapter" if o.target in needs_base else "adapter"
                result.adapter[o.target] = name
                if o.ok:
                    self.served.setdefault(name, set()).add(o.target)
            log.debug("weight_sync: adapter %r to %d replicas in %.3fs", self.name, len(adapters),
                      time.perf_counter() - t0)
        result.outcomes = [done[t] for t in targets]
        return result

    async def unload(self, name: str) -> dict[str, str]:
        """UnloadAdapter of `name` on every replica a push gave it to, so their adapter slots free up (the trainer
        deleted it): {target: "unloaded" | "not loaded" | the error}. A replica that fails keeps the adapter until it
        restarts; the delete itself is not undone for it."""
        targets = sorted(self.served.pop(name, set()))

        async def one(target: str) -> str:
            try:
                async with self._rpc.channel(target) as ch:
                    r = await rollout_pb2_grpc.RolloutStub(ch).UnloadAdapter(
                        rollout_pb2.UnloadAdapterRequest(name=name), metadata=self._rpc.metadata, timeout=30.0)
                return "unloaded" if r.unloaded else "not loaded"
            except Exception as e:  # noqa: BLE001 - reported per replica; the others still unload
                log.warning("weight_sync: UnloadAdapter %r on %s failed (%s)", name, target, error_text(e))
                return error_text(e)

        return dict(zip(targets, await asyncio.gather(*(one(t) for t in targets))))
