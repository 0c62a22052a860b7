"""Pipeline parallel: cut a HF decoder into stages and run them with torch.distributed.pipelining.

A stage keeps the model object and its Hugging Face parameter names (checkpoints and weight sync
see the same FQNs on any mesh); it drops the layers other stages own and replaces the model's
forward by the stage's piece: embed (first stage) -> its layers -> norm + LM head (last stage).
"""

from __future__ import annotations

import logging
import types

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger("meshrl.trainer")

SCHEDULES = ("1f1b", "gpipe")


def stage_layer_range(num_layers: int, stage: int, num_stages: int) -> range:
    """Contiguous, balanced layer ranges; earlier stages take the remainder (they also embed)."""
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def _stage_forward(self, x: torch.Tensor) -> torch.Tensor:
    """input ids [B, L] (first stage) or hidden states [B, L, H] -> hidden states, or logits on the last."""
    inner = self.model
    h = inner.embed_tokens(x) if inner.embed_tokens is not None else x
    positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
    rope = inner.rotary_emb(h, positions)
    # Right padding and a causal mask: a real token never attends to padding, so no padding mask is
    # needed (SDPA applies the causal mask when it gets none).
    for layer in inner.layers.values():
        h = layer(h, attention_mask=None, position_embeddings=rope, position_ids=positions)
    if inner.norm is not None:
        h = inner.norm(h)
    if self.lm_head is not None:
        h = self.lm_head(h)
    return h


def split_stage(model: nn.Module, pp_mesh: DeviceMesh) -> None:
    """Keeps this rank's stage of `model` in place (no-op for one stage)."""
    num_stages = pp_mesh.size()
    if num_stages == 1:
        return
    if not hasattr(model, "lm_head"):
        raise ValueError("actor.pp_size > 1: pipeline parallel supports causal LMs only (no critic yet)")
    attn = getattr(model.config, "_attn_implementation", "sdpa")
    if attn not in ("sdpa", "flash_attention_2", "flash_attention_3"):
        raise ValueError(f"actor.pp_size > 1: needs a causal attention kernel (sdpa/flash), model uses {attn!r}")
    stage = pp_mesh.get_local_rank()
    layers = model.model.layers
    if len(layers) < num_stages:
        raise ValueError(f"actor.pp_size: {num_stages} stages for {len(layers)} layers")
    owned = stage_layer_range(len(layers), stage, num_stages)
    # A ModuleDict keyed by the original index keeps the names model.layers.<i>.*.
    model.model.layers = nn.ModuleDict({str(i): layers[i] for i in owned})
    if stage != 0:
        model.model.embed_tokens = None
    if stage != num_stages - 1:
        model.model.norm = None
        model.lm_head = None
    # An instance attribute, not a subclass: FQNs, save_pretrained and config stay those of the HF class.
    model.forward = types.MethodType(_stage_forward, model)
    log.info("Pipeline stage %d/%d holds layers %d-%d", stage, num_stages, owned.start, owned.stop - 1)


def tied_embedding(model: nn.Module, pp_mesh: DeviceMesh) -> torch.Tensor | None:
    """The copy of a tied embedding this stage holds when the first and last stages both hold one."""
    if pp_mesh.size() == 1 or not model.config.tie_word_embeddings:
        return None
    stage = pp_mesh.get_local_rank()
    if stage == 0:
        return model.model.embed_tokens.weight
    if stage == pp_mesh.size() - 1:
        return model.lm_head.weight
    return None


def build_schedule(model: nn.Module, pp_mesh: DeviceMesh, device: torch.device, *, num_microbatches: int,
                   schedule: str, loss_fn=None):
    """A fresh stage + schedule (cheap): shapes change from batch to batch and stages infer them once."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stage = PipelineStage(model, pp_mesh.get_local_rank(), pp_mesh.size(), device, group=pp_mesh.get_group())
    cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
    # scale_grads=False: the loss already carries the mini-batch normaliser, so micro-batches just add up.
    return cls(stage, num_microbatches, loss_fn=loss_fn, scale_grads=False)
