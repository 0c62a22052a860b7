"""Applies the mesh to a model in a fixed order: tensor parallel, activation checkpointing, then FSDP or DDP.

Each step is a no-op when its mesh axis has size 1, so a single CPU process runs this same code.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from services.common.codec import DTYPES

log = logging.getLogger("meshrl.trainer")


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder layers of a HF causal LM (or of a value model wrapping its backbone)."""
    for path in ("model.layers", "model.model.layers", "layers"):
        node = model
        try:
            for part in path.split("."):
                node = getattr(node, part)
        except AttributeError:
            continue
        return list(node)
    raise ValueError(f"{type(model).__name__}: no decoder layers found (expected model.layers)")


def apply_activation_checkpointing(model: nn.Module, enabled: bool) -> None:
    if not enabled:
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    blocks = transformer_blocks(model)
    parent = _blocks_parent(model)
    for i, block in enumerate(blocks):
        parent[i] = checkpoint_wrapper(block)
    log.info("Applied activation checkpointing to %d blocks", len(blocks))


def _blocks_parent(model: nn.Module) -> nn.ModuleList:
    for path in ("model.layers", "model.model.layers", "layers"):
        node = model
        try:
            for part in path.split("."):
                node = getattr(node, part)
        except AttributeError:
            continue
        return node
    raise ValueError("no decoder layers")


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, *, param_dtype: str, compute_dtype: str) -> None:
    """FSDP2: every block is its own all-gather unit, the root holds embeddings, norm and head."""
    if dp_mesh.size() == 1:
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # Gradients are reduced in fp32 whatever the compute dtype, so accumulation stays exact.
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[compute_dtype], reduce_dtype=torch.float32) \
        if compute_dtype != param_dtype else MixedPrecisionPolicy()
    blocks = transformer_blocks(model)
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    log.info("Applied FSDP to %d blocks (dp=%d)", len(blocks), dp_mesh.size())


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """Replicates the model over the DP axis; returns the module to call forward on."""
    if dp_mesh.size() == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    # Every parameter takes part in every forward, so DDP never searches for unused ones.
    wrapped = DistributedDataParallel(model, process_group=dp_mesh.get_group(), find_unused_parameters=False)
    log.info("Applied DDP (dp=%d)", dp_mesh.size())
    return wrapped


def parallelize(model: nn.Module, mesh: DeviceMesh, *, dp_mode: str, activation_checkpointing: bool,
                param_dtype: str, compute_dtype: str) -> nn.Module:
    """TP -> activation checkpointing -> FSDP/DDP. Returns the module to run forward/backward through."""
    if mesh["tp"].size() > 1 or mesh["pp"].size() > 1:
        raise ValueError("actor.tp_size / actor.pp_size > 1: tensor and pipeline parallel are not implemented "
                         "yet (use dp_size)")
    apply_activation_checkpointing(model, activation_checkpointing)
    if dp_mode == "fsdp":
        apply_fsdp(model, mesh["dp"], param_dtype=param_dtype, compute_dtype=compute_dtype)
        return model
    return apply_ddp(model, mesh["dp"])
