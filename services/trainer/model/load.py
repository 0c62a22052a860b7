"""Loading the models a trainer rank trains from Hugging Face folders, and the `auto` switches that change their
forward: the fused LM head and packed rows, each resolved once, out loud, in the rank's `Resolved`."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
from torch import nn

from services.common.auto import Auto, Resolved
from services.common.tensors.codec import DTYPES
from services.common.tensors.fused import enable_fused_head, supports_fused_head
from services.common.tensors.modeling import load_causal_lm
from services.common.tensors.packing import enable_packing, supports_packing
from services.trainer.config import TrainerSettings, check_lora_targets
from services.trainer.model.lora import apply_lora
from services.trainer.model.trained import ValueModel

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def load_actor(settings: TrainerSettings, model_path: str, *, param_dtype: str,
               device: torch.device) -> tuple[nn.Module, PretrainedConfig]:
    """The initial policy, as Hugging Face loads it (seeded first: nothing random may differ across ranks), and
    the config ExportHF writes beside its weights."""
    a, m = settings.actor, settings.model
    torch.manual_seed(a.seed)
    # Under LoRA the frozen base stays in model.dtype; only the adapters hold master weights.
    module = load_causal_lm(model_path, dtype=m.dtype if a.lora else param_dtype, device=str(device), trainable=True)
    # No dropout in RL updates: at the first step of a batch the ratio to the old policy must be exactly 1.
    module.train(False)
    hf_config = copy.deepcopy(module.config)
    if a.lora:
        check_lora_targets(model_path, a.lora)
        apply_lora(module, a.lora, adapter_dtype=DTYPES[param_dtype])
    hf_config.architectures = [type(module).__name__]
    # What ExportHF writes: the model's dtype (or weight_sync_dtype), not the fp32 master weights'.
    hf_config.dtype = a.weight_sync_dtype or m.dtype
    return module, hf_config


def load_value_model(path: str, *, param_dtype: str, device: torch.device, packed: bool) -> ValueModel:
    """The critic: the causal LM's backbone at `path` with a fresh scalar head, in the master weights' dtype."""
    from transformers import AutoModel

    backbone = AutoModel.from_pretrained(path, dtype=DTYPES[param_dtype], local_files_only=True)
    if packed:
        enable_packing(backbone, "actor.use_remove_padding")
    model = ValueModel(backbone, backbone.config.hidden_size).to(device=device, dtype=DTYPES[param_dtype])
    model.train(False)
    return model


def setup_fused_head(module: nn.Module, wanted: bool | Auto | None, *, resolved: Resolved, pp: int) -> bool:
    """Turns the fused head on where it applies (null: wherever it can; true on a head it cannot fuse is refused
    by enable_fused_head). Pipeline stages compute their log-probs from the last stage's hidden states in chunks
    whatever this says (services/trainer/parallel/pipeline.py). Under TP the head is vocab-parallel
    (services/common/tensors/vocab_parallel.py)."""
    if pp > 1:
        return resolved.pick("actor.fused_logprobs", wanted if wanted is not True else False, False,
                             "pipeline stages compute log-probs in chunks on the last stage")
    reason = supports_fused_head(module)
    if not resolved.pick("actor.fused_logprobs", wanted, reason is None,
                         "the LM head can be fused" if reason is None else reason):
        return False
    enable_fused_head(module)
    return True


def setup_packing(module: nn.Module, wanted: bool | Auto | None, *, resolved: Resolved, pp: int,
                  device: torch.device, compute_dtype: str) -> bool:
    """Packed rows (remove padding). Null: on for half-precision compute on CUDA wherever the model and mesh
    allow (the varlen kernel; measured faster than padded rows on one H200, bench/results/trainer_packing.json),
    off elsewhere; true under PP or on a model whose attention cannot be confined to each sequence is refused
    by name."""
    if pp > 1 and wanted is True:
        raise ValueError("actor.use_remove_padding: pipeline stages run right-padded rows "
                         "(actor.pp_size > 1); leave it auto or set it false")
    why_not = ("actor.pp_size > 1: pipeline stages run right-padded rows" if pp > 1
               else f"device {device.type}" if device.type != "cuda"
               else f"compute dtype {compute_dtype}" if compute_dtype not in ("bfloat16", "float16")
               else supports_packing(module))
    if not resolved.pick("actor.use_remove_padding", wanted, why_not is None,
                         "half-precision compute on CUDA" if why_not is None else why_not):
        return False
    enable_packing(module, "actor.use_remove_padding")
    return True
