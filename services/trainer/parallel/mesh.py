"""The trainer's device mesh: ParallelDims, process-group start-up, the group commands travel on, collectives.

The trainer always runs inside a process group: under torchrun it joins the launched world
(env://); alone it starts a one-rank gloo group on an in-memory store. So one CPU process runs the
same collectives, mesh and code as a TP x PP x DP mesh on GPUs; every degree-1 axis is a no-op.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from services.trainer.config import check_mesh

log = logging.getLogger("meshrl.trainer")

# Ranks > 0 wait for rank 0's next command while the service is idle; that wait must not time out.
IDLE_TIMEOUT = datetime.timedelta(days=365)


def launched_world_size() -> int:
    """World size torchrun announced (1 when started directly)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_rank() -> int:
    return int(os.environ.get("RANK", "0"))


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of the trainer mesh; their product must be the world size."""

    dp: int
    pp: int
    tp: int
    world_size: int

    def __post_init__(self):
        for name, value in (("dp_size", self.dp), ("pp_size", self.pp), ("tp_size", self.tp)):
            if value < 1:
                raise ValueError(f"actor.{name}: must be >= 1, got {value}")
        check_mesh(self.tp, self.pp, self.dp, self.world_size, launch="torchrun --nproc_per_node x --nnodes")

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """A (pp, dp, tp) mesh: tp innermost so a TP group shares a host's fast links."""
        return init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=("pp", "dp", "tp"))

    def describe(self) -> str:
        return f"tp={self.tp} pp={self.pp} dp={self.dp}"


def init_distributed(device_type: str) -> None:
    """Joins the torchrun world, or starts a one-rank group when there is none (idempotent)."""
    if dist.is_initialized():
        return
    # CPU tensors (metrics, pickled objects) go over gloo, GPU tensors over NCCL, in one group.
    backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
    if "MASTER_ADDR" in os.environ and "RANK" in os.environ:
        dist.init_process_group(backend=backend, init_method="env://")
    else:
        # An in-memory store: no port, no file, and any number of engines in one test process share it.
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)


def local_device(device: str) -> torch.device:
    """`cuda` means this rank's GPU (LOCAL_RANK); anything else is used as given."""
    if device == "cuda":
        index = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device(device)


def object_group():
    """A gloo group of every rank for pickled objects: rank 0's commands (services/trainer/commands.py) and what
    ranks gather back to it. Separate, so they never queue behind NCCL kernels, and without a deadline: ranks > 0
    wait on it while the service is idle. None in a one-rank world."""
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT) if dist.get_world_size() > 1 else None


def all_reduce_sum(values: list[float], group=None, device: torch.device | str = "cpu") -> list[float]:
    """Sums a list of floats over a group (the DP group for metrics); one collective for all of them."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t.tolist()


def gather_to_rank0(obj: Any, group=None) -> list[Any] | None:
    """Every rank's `obj` on rank 0 (None elsewhere); pass the (gloo) command group so any object works."""
    world = dist.get_world_size()
    out = [None] * world if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0, group=group)
    return out
