"""NVTX ranges around the trainer's phases, for Nsight Systems timelines; nothing at all without CUDA.

`nsys profile -t cuda,nvtx torchrun ... -m services.trainer ...` shows each phase as a named range on
every rank's timeline. The names are documented in docs/trainer.md and fixed here.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext

import torch

PHASES = (
    "logprobs",           # ComputeLogProbs: forward only, the whole call
    "values",             # ComputeValues: forward only, the whole call
    "forward_backward",   # one mini-batch's forwards and backwards (all its micro-batches, every pipeline stage)
    "optimizer",          # grad norm, clip / loss-scale unscale, optimizer and scheduler step of one mini-batch
    "state_for_sync",     # gathering full weights for PushWeights (state_for_sync)
    "export_hf",          # ExportHF: gather and write safetensors
    "save_checkpoint",    # SaveCheckpoint (DCP write)
    "load_checkpoint",    # LoadCheckpoint (DCP read)
)


@functools.cache
def _cuda() -> bool:
    return torch.cuda.is_available()


def phase(name: str):
    """A context manager: an NVTX range `name` (one of PHASES) on CUDA builds with a GPU, else a shared no-op."""
    assert name in PHASES, name
    if not _cuda():
        return _NOOP
    return torch.cuda.nvtx.range(name)


_NOOP = nullcontext()
