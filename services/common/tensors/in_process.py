"""The ipc transport's shared buffers of this process, by buffer id. A replica in the trainer's own process (an
in-process mesh: services/local.py, as bench/many_runs.py runs it) cannot open them by handle (cudaIpcOpenMemHandle
refuses a handle of its own process: "invalid device context"), and needs not: it reads the buffer itself."""

from __future__ import annotations

import weakref

import torch

_BUFFERS: "weakref.WeakValueDictionary[str, torch.Tensor]" = weakref.WeakValueDictionary()    # the sender owns them


def share_in_process(buffer_id: str, buf: torch.Tensor) -> None:
    """Registers an ipc sender's shared buffer for replicas in this process (IpcReceiver looks here first)."""
    _BUFFERS[buffer_id] = buf


def in_process_buffer(buffer_id: str) -> torch.Tensor | None:
    """The shared buffer `buffer_id` when this process's ipc sender made it, else None (open its handle)."""
    return _BUFFERS.get(buffer_id)
