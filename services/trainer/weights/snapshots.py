"""Adapter pushes that wait for no trainer command (several LoRA runs on one trainer, docs/many_runs.md).

The trainer runs one command at a time, so a push that reads an adapter's weights through a command queues behind the
other runs' updates. Instead, each command that changes a LoRA adapter's weights stores, before it releases the
command lock, what a push of that adapter sends at its new version, made as the push makes it
(weights/full.full_weights for the run's adapter, model/adapter_set.for_sync for a named one). The commands that do
(services/trainer/commands.py): train_actor, train_dpo, optim_step, start_from_model, start_from_checkpoint,
load_checkpoint, create_adapter, load_adapter, and the push's own command (state_for_sync / adapter_for_sync of kind
"adapter"); delete_adapter drops the adapter's snapshot.

A push of an adapter whose stored snapshot is of the adapter's version now, in the form it asks for (on CPU, or on the
device for ipc and nccl), sends that snapshot and runs no command (`held`); any other push (no snapshot, the version
moved, another form, merged or base weights, full-parameter weights, a trainer of several processes, where the state
needs a collective) runs the command as before. A snapshot is never written to: the next change replaces it.
Snapshots are kept once an adapter push has asked for one (none on a trainer that never pushes adapters), one per
adapter.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

import torch

from services.trainer.model import adapter_set
from services.trainer.weights import full

log = logging.getLogger("meshrl.trainer")


@dataclass(frozen=True)
class Snapshot:
    """What a push of one adapter sends at `version`: its tensors as the push makes them, in one form."""

    version: int
    on_device: bool
    owner: object | None                   # the NamedAdapter copied (None: the run's): a re-created one matches none
    state: Mapping[str, torch.Tensor]      # read-only; the tensors are never written


@dataclass
class Snapshots:
    """Rank 0's snapshot per adapter ("" = the run's) and the form each adapter's pushes ask for."""

    taken: dict[str, Snapshot] = field(default_factory=dict)
    forms: dict[str, bool] = field(default_factory=dict)        # adapter -> on_device of its last push
    last_form: bool | None = None           # of the last push of any adapter (a new adapter's form); None: no push yet


def of(rank) -> Snapshots:
    """The rank's snapshots (made on first use; setdefault: a push's thread and a command's may both ask first)."""
    return rank.__dict__.setdefault("sync_snapshots", Snapshots())


def _kept(rank) -> bool:
    """Snapshots are kept on a LoRA trainer of one process: a sharded adapter's state needs a collective."""
    return rank.cfg.lora is not None and rank.dims.world_size == 1


def _current(rank, name: str) -> tuple[object | None, int] | None:
    """(owner, weight version now) of adapter `name`, or None when it is gone."""
    if not name:
        return None, rank.weight_version
    owner = adapter_set.named(rank).get(name)
    return None if owner is None else (owner, owner.weight_version)


def keep(rank, name: str, state: dict[str, torch.Tensor], on_device: bool) -> None:
    """Stores `state` (made this command, the adapter's sync state at its version now) as adapter `name`'s snapshot."""
    now = _current(rank, name)
    if now is not None and _kept(rank):
        of(rank).taken[name] = Snapshot(now[1], on_device, now[0], MappingProxyType(dict(state)))


def store(rank, name: str = "") -> None:
    """Inside a command that changed adapter `name`'s weights ("" = the run's), after its version moved: replaces
    its snapshot with one of the new weights, in the form its pushes ask for; nothing before any adapter push."""
    snaps = of(rank)
    on_device = snaps.forms.get(name, snaps.last_form)
    if on_device is None or not _kept(rank):
        return
    snaps.taken.pop(name, None)             # never the old weights under a version that may not have moved
    try:
        state = (adapter_set.for_sync(rank, name, on_device) if name else
                 full.full_weights(rank, on_device, "adapter"))
    except Exception as e:  # noqa: BLE001 - the command's change stands; pushes of it run the command instead
        log.warning("weight_sync: snapshot of adapter %r failed (%s); its pushes run a trainer command",
                    name or "default", e)
        return
    keep(rank, name, state, on_device)


def drop(rank, name: str) -> None:
    """Adapter `name` was deleted: its snapshot and form go with it."""
    snaps = of(rank)
    snaps.taken.pop(name, None)
    snaps.forms.pop(name, None)


def held(rank, name: str, on_device: bool) -> tuple[dict[str, torch.Tensor], int] | None:
    """A push of adapter `name` (kind "adapter") in form `on_device`, without the command lock: the stored snapshot
    and its version when it is of the adapter's version now, else None (run the command). Records the form the
    next snapshots are made in."""
    if not _kept(rank):
        return None
    snaps = of(rank)
    snaps.forms[name] = snaps.last_form = on_device
    snap = snaps.taken.get(name)            # immutable: its tensors and version belong together whatever runs now
    now = _current(rank, name)
    if snap is None or now is None or snap.on_device != on_device or snap.owner is not now[0] or \
            snap.version != now[1]:
        return None
    return dict(snap.state), snap.version
