"""Pipeline parallel: cut a HF decoder into stages and run them with torch.distributed.pipelining.

A stage keeps the model object and its Hugging Face parameter names (checkpoints and weight sync
see the same FQNs on any mesh); it drops the layers other stages own and replaces the model's
forward by the stage's piece: embed (first stage) -> its layers -> norm + LM head (last stage).

With several stages per rank (interleaved 1F1B, loop placement: rank r holds stages r, r + pp, ...)
each stage is a light copy of the model's skeleton holding its own layers, and the model object itself
becomes the container of everything this rank holds: parameters, optimizer, checkpoints and weight
export keep reading HF names off it, while the schedule runs the stages.
"""

from __future__ import annotations

import copy
import logging
import types
from typing import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from services.trainer.config import MULTI_STAGE_SCHEDULES, check_microbatches

log = logging.getLogger("meshrl.trainer")


def stage_layer_range(num_layers: int, stage: int, num_stages: int) -> range:
    """Contiguous, balanced layer ranges; earlier stages take the remainder (they also embed)."""
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def stage_indices(pp_rank: int, pp_size: int, stages_per_rank: int) -> list[int]:
    """The stages a rank holds under loop placement (what the interleaved schedule expects)."""
    return [pp_rank + j * pp_size for j in range(stages_per_rank)]


def check_stage_split(num_layers: int, pp_size: int, stages_per_rank: int) -> None:
    """Every stage needs at least one decoder layer."""
    num_stages = pp_size * stages_per_rank
    if num_layers < num_stages:
        key = "actor.pp_stages_per_rank" if stages_per_rank > 1 else "actor.pp_size"
        raise ValueError(f"{key}: pp_size={pp_size} x pp_stages_per_rank={stages_per_rank} = {num_stages} "
                         f"pipeline stages for {num_layers} decoder layers (each stage needs at least one)")


def _stage_forward(self, x: torch.Tensor) -> torch.Tensor:
    """input ids [B, L] (first stage) or hidden states [B, L, H] -> hidden states; the last stage's are after
    the final norm, and the LM head runs in the loss (`stage_logprobs`): no [B, L, vocab] logits."""
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
    return h


def last_stage_head(stages: Sequence[nn.Module]) -> torch.Tensor:
    """The LM head's weight [V, d] of this rank's last stage (inside a DDP wrapper or not)."""
    stage = stages[-1]
    return getattr(stage, "module", stage).lm_head.weight


def stage_logprobs(hidden: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor,
                   mask: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, entropy) [B, R] of the targets [B, R] from the last stage's hidden states [B, L, d] at the response
    positions [B, R], masked: the fused head (services/common/tensors/fused.py) in row chunks over the real tokens only,
    vocab-parallel when the head is tensor-parallel."""
    from services.common.tensors.fused import head_logprobs
    from services.common.tensors.vocab_parallel import vocab_parallel_logprobs

    B, R = positions.shape
    flat = mask.reshape(-1).nonzero().squeeze(-1)                                           # [N]
    rows = (torch.arange(B, device=positions.device).unsqueeze(1) * hidden.shape[1] + positions).reshape(-1)
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows.index_select(0, flat))  # [N, d]
    tokens = targets.reshape(-1).index_select(0, flat)
    if hasattr(weight, "placements"):
        if weight.device_mesh.mesh_dim_names != ("tp",):
            raise RuntimeError(f"the last stage's LM head is sharded over {weight.device_mesh.mesh_dim_names}, "
                               "not only the tensor-parallel axis")
        logp, ent = vocab_parallel_logprobs(h, weight, tokens, temperature)
    else:
        device_type = h.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
        logp, ent = head_logprobs(h.to(dtype), weight.to(dtype), tokens, temperature)
    out_logp = torch.zeros(B * R, dtype=logp.dtype, device=logp.device).index_copy(0, flat, logp)
    out_ent = torch.zeros(B * R, dtype=ent.dtype, device=ent.device).index_copy(0, flat, ent)
    return out_logp.view(B, R), out_ent.view(B, R)


def _container_forward(self, *args, **kwargs):
    raise RuntimeError("this model holds several pipeline stages; run them through the pipeline schedule")


def _keep(model: nn.Module, layers: dict[str, nn.Module], *, first: bool, last: bool, embed, norm, head) -> None:
    """Makes `model` hold only the given layers (ModuleDict keyed by original index: names stay
    model.layers.<i>.*), the embedding if first and norm + head if last."""
    model.model.layers = nn.ModuleDict(layers)
    model.model.embed_tokens = embed if first else None
    model.model.norm = norm if last else None
    model.lm_head = head if last else None


def split_stages(model: nn.Module, pp_mesh: DeviceMesh, stages_per_rank: int = 1) -> list[nn.Module]:
    """This rank's pipeline stages of `model`, in stage order ([model] itself for one stage per rank, and a
    no-op without PP). With several, `model` keeps every layer this rank holds (see `hold_stages`)."""
    pp = pp_mesh.size()
    if pp == 1:
        return [model]
    if not hasattr(model, "lm_head"):
        raise ValueError("actor.pp_size > 1: pipeline parallel supports causal LMs only (no critic yet)")
    attn = getattr(model.config, "_attn_implementation", "sdpa")
    if attn not in ("sdpa", "flash_attention_2", "flash_attention_3", "meshrl_packed"):
        raise ValueError(f"actor.pp_size > 1: needs a causal attention kernel (sdpa/flash), model uses {attn!r}")
    layers = model.model.layers
    check_stage_split(len(layers), pp, stages_per_rank)
    num_stages = pp * stages_per_rank
    embed, norm, head = model.model.embed_tokens, model.model.norm, model.lm_head
    ids = stage_indices(pp_mesh.get_local_rank(), pp, stages_per_rank)
    owned = [stage_layer_range(len(layers), s, num_stages) for s in ids]
    if stages_per_rank == 1:
        chunks = [model]
    else:
        # The skeleton (config, rotary tables, no weights) is copied once per stage; the layers, embedding,
        # norm and head are shared with `model`, never copied.
        _keep(model, {}, first=False, last=False, embed=None, norm=None, head=None)
        chunks = [copy.deepcopy(model) for _ in ids]
        # An instance attribute, like a stage's forward: `model` only holds parameters now.
        model.forward = types.MethodType(_container_forward, model)
    for chunk, s, rng in zip(chunks, ids, owned):
        _keep(chunk, {str(i): layers[i] for i in rng}, first=s == 0, last=s == num_stages - 1,
              embed=embed, norm=norm, head=head)
        # An instance attribute, not a subclass: FQNs, save_pretrained and config stay those of the HF class.
        chunk.forward = types.MethodType(_stage_forward, chunk)
        log.info("Pipeline stage %d/%d holds layers %d-%d", s, num_stages, rng.start, rng.stop - 1)
    if stages_per_rank > 1:
        hold_stages(model, chunks)
    return chunks


def hold_stages(model: nn.Module, chunks: Sequence[nn.Module]) -> None:
    """Points the container `model` at its stages' (possibly wrapped) layers, embedding, norm and head, so its
    parameters are exactly theirs under HF names. Called again after TP / checkpointing / FSDP wrap them."""
    if len(chunks) == 1 and chunks[0] is model:
        return
    inner = [c.model for c in chunks]
    layers = {k: m for c in inner for k, m in c.layers.items()}
    model.model.layers = nn.ModuleDict({k: layers[k] for k in sorted(layers, key=int)})
    model.model.embed_tokens = next((c.embed_tokens for c in inner if c.embed_tokens is not None), None)
    model.model.norm = next((c.norm for c in inner if c.norm is not None), None)
    model.lm_head = next((c.lm_head for c in chunks if c.lm_head is not None), None)


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


def build_schedule(stages: Sequence[nn.Module], pp_mesh: DeviceMesh, device: torch.device, *,
                   num_microbatches: int, schedule: str, loss_fn=None):
    """Fresh stages + schedule (cheap): shapes change from batch to batch and stages infer them once.
    `stages` are this rank's stage modules in stage order (one unless the schedule interleaves)."""
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B)

    pp = pp_mesh.size()
    ids = stage_indices(pp_mesh.get_local_rank(), pp, len(stages))
    built = [PipelineStage(m, i, pp * len(stages), device, group=pp_mesh.get_group()) for m, i in zip(stages, ids)]
    # scale_grads=False: the loss already carries the mini-batch normaliser, so micro-batches just add up.
    if schedule in MULTI_STAGE_SCHEDULES:
        check_microbatches(schedule, num_microbatches, pp)
        return ScheduleInterleaved1F1B(built, num_microbatches, loss_fn=loss_fn, scale_grads=False)
    assert len(built) == 1, f"{schedule} runs one stage per rank"
    cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
    return cls(built[0], num_microbatches, loss_fn=loss_fn, scale_grads=False)
