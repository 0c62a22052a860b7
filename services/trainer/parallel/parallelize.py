"""Applies the mesh to a model in a fixed order: tensor parallel, activation checkpointing, compile, then FSDP or DDP.

Each step is a no-op when its mesh axis has size 1, so a single CPU process runs this same code.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from services.common.tensors.codec import DTYPES
from services.common.tensors.compile import apply_compile, blocks_container, transformer_blocks

log = logging.getLogger("meshrl.trainer")


# Ops whose outputs selective checkpointing keeps: the matmuls and attention (the expensive part of a
# block), the LoRA-adapted linears included (alone and grouped); everything else (norms, activations, rotary,
# residual adds) is recomputed in backward.
def _saved_ops() -> set:
    import services.trainer.model.lora_group  # noqa: F401  (registers meshrl::lora_linear and meshrl::lora_group)

    ops = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.linear.default, torch.ops.meshrl.lora_linear.default, torch.ops.meshrl.lora_group.default}
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"):
        if hasattr(torch.ops.aten, name):
            ops.add(getattr(torch.ops.aten, name).default)
    return ops


def _selective_context():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = _saved_ops()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


def _checkpointed_forward(block: nn.Module, inner, selective: bool):
    """The block's own forward run under torch.utils.checkpoint (non-reentrant: what torch's checkpoint_wrapper
    runs), installed on the instance so the module tree, parameter names and state dicts stay the model's own."""
    from torch.utils.checkpoint import checkpoint

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():           # log-prob passes: nothing to recompute
            return inner(*args, **kwargs)
        extra = {"context_fn": _selective_context} if selective else {}
        return checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=False, **extra, **kwargs)
    return forward


def checkpointed_blocks(num_blocks: int, mode: str, every: int) -> list[int]:
    """Indices of the blocks that recompute: none; full every `every`-th block (0, every, 2 * every, ...); or
    selective (op-level) on every block."""
    if mode == "none":
        return []
    step = every if mode == "full" else 1
    return list(range(0, num_blocks, step))


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int = 1) -> None:
    """Per-block activation checkpointing (see ActorConfig.activation_checkpointing). The blocks keep their
    names: nothing is wrapped, so weight sync, DCP checkpoints and ExportHF see the model's own names."""
    container = blocks_container(model)
    # A pipeline stage holds a ModuleDict keyed by the model's layer index: every k-th counts globally.
    blocks = ({int(k): b for k, b in container.items()} if isinstance(container, nn.ModuleDict)
              else dict(enumerate(container)))
    chosen = set(checkpointed_blocks(max(blocks) + 1 if blocks else 0, mode, every))
    for i, block in blocks.items():
        if i in chosen:
            block.forward = _checkpointed_forward(block, block.forward, selective=mode == "selective")
    done = len(chosen & set(blocks))
    if done:
        log.info("Applied %s activation checkpointing to %d of %d blocks", mode, done, len(blocks))


def tp_plan(model: nn.Module) -> tuple[dict, dict]:
    """The one per-architecture tensor-parallel plan (Megatron-style) for Llama and Qwen2 decoders.

    Attention and MLP inputs are column-split and their outputs row-split, so each block needs one
    all-reduce per sub-layer; the (possibly tied) embedding and LM head split the vocabulary.
    Returns (root plan, per-block plan).
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in TP_ARCHITECTURES:
        raise ValueError(f"actor.tp_size: no tensor-parallel plan for model type {model_type!r} "
                         f"(have {', '.join(TP_ARCHITECTURES)})")
    root = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    block = {
        "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel(),
    }
    return root, block


TP_ARCHITECTURES = ("llama", "qwen2")


def check_tp_divisibility(config, tp: int) -> None:
    """Heads, KV heads, MLP width and vocabulary must split evenly over the TP ranks."""
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        value = getattr(config, key, None)
        if value is not None and value % tp:
            raise ValueError(f"actor.tp_size: {key}={value} of the model is not divisible by tp_size={tp}")


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    if tp_mesh.size() == 1:
        return
    from torch.distributed.tensor.parallel import parallelize_module

    check_tp_divisibility(model.config, tp_mesh.size())
    root, block = tp_plan(model)
    # A value model has the backbone's embedding but no LM head.
    has_head = hasattr(model, "lm_head")
    tied = has_head and model.config.tie_word_embeddings
    for layer in transformer_blocks(model):
        parallelize_module(layer, tp_mesh, block)
    if model.model.embed_tokens is not None:      # None on later pipeline stages
        parallelize_module(model, tp_mesh, {"model.embed_tokens": root["model.embed_tokens"]})
    has_head = has_head and model.lm_head is not None
    tied = tied and has_head and model.model.embed_tokens is not None
    if tied:
        # Both plans shard the shared [vocab, hidden] weight on dim 0; hand the head the embedding's
        # DTensor so the tie survives, then re-tie after the head's plan re-registers it.
        model.lm_head.weight = model.model.embed_tokens.weight
    if has_head:
        parallelize_module(model, tp_mesh, {"lm_head": root["lm_head"]})
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    log.info("Applied tensor parallel to %d blocks (tp=%d)", len(transformer_blocks(model)), tp_mesh.size())


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


def parallelize(model: nn.Module, mesh: DeviceMesh, *, dp_mode: str, activation_checkpointing: str,
                param_dtype: str, compute_dtype: str, compile: bool = False,
                stages_per_rank: int = 1, checkpoint_every: int = 1) -> list[nn.Module]:
    """PP stage split -> TP -> activation checkpointing -> compile -> FSDP/DDP, stage by stage. Returns the
    modules to run forward/backward through: one per pipeline stage this rank holds (without PP, the model
    itself or its DDP wrapper). `model` keeps every parameter this rank holds, under HF names."""
    from services.trainer.parallel.pipeline import hold_stages, split_stages

    chunks = split_stages(model, mesh["pp"], stages_per_rank)
    out = []
    for chunk in chunks:
        apply_tp(chunk, mesh["tp"])
        apply_activation_checkpointing(chunk, activation_checkpointing, checkpoint_every)
        apply_compile(chunk, compile)
        if dp_mode == "fsdp":
            # Several stages per rank: each is its own FSDP root (the schedule unshards and reshards it).
            apply_fsdp(chunk, mesh["dp"], param_dtype=param_dtype, compute_dtype=compute_dtype)
            out.append(chunk)
        else:
            out.append(apply_ddp(chunk, mesh["dp"]))
    # Checkpointing and compile may have replaced the stages' layers; the model must hold the same modules.
    hold_stages(model, chunks)
    return out
