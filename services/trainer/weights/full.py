"""The rank commands that take the actor's weights out whole: every weight on rank 0, for a push to rollout replicas
(`full_weights`, the state_for_sync command) or written as a Hugging Face folder (`export_hf`)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch

from services.common.tensors.codec import DTYPES
from services.common.tensors.device_staging import cast_copies
from services.common.tensors.weights import named_weights
from services.trainer.model.lora import adapter_state, base_weights, merged_weights
from services.trainer.parallel.mesh import gather_to_rank0
from services.trainer.rank import Rank
from services.trainer.weights.gather import stage_gatherers

log = logging.getLogger("meshrl.trainer")


# What a push may carry (state_for_sync's kind): the model whole (merged under LoRA), the frozen base alone (a
# replica serving adapters over another base gets it once), or the adapter alone (services/trainer/weights/adapter.py).
SYNC_KINDS = ("full", "base", "adapter")


def sync_source(rank: Rank, kind: str) -> dict[str, torch.Tensor]:
    """The local (possibly sharded) tensors a push of `kind` carries."""
    if kind not in SYNC_KINDS:
        raise ValueError(f"state_for_sync: kind must be one of {SYNC_KINDS}, got {kind!r}")
    if kind != "full" and not rank.cfg.lora:
        raise ValueError(f"state_for_sync: kind {kind!r} needs actor.lora")
    module = rank.actor.module
    if kind == "adapter":
        return adapter_state(module)         # PEFT's saved names: base_model.model.<layer>.lora_A.weight
    if kind == "base":
        return base_weights(module)
    # Under LoRA: the base weights with the adapters merged in, under the model's own names.
    return merged_weights(module) if rank.cfg.lora else named_weights(module)


@torch.no_grad()
def full_weights(rank: Rank, on_device: bool = False, kind: str = "full") -> dict[str, torch.Tensor] | None:
    """Every actor weight of a push of `kind` (SYNC_KINDS), full and on CPU (on_device: on rank 0's device), on
    rank 0 (None elsewhere): HF names, tied weights once.

    Each pipeline stage's TP/FSDP shards are gathered to the stage's sender (its rank at dp = tp = 0) in
    buckets of weight_sync.device_bucket_bytes, one gather per bucket (services/trainer/weights/gather.py); the
    stages' senders then send their part to rank 0.
    """
    # Replicas and exported folders hold the model's dtype, whatever the master weights' dtype.
    dtype = DTYPES[rank.cfg.weight_sync_dtype or rank.settings.model.dtype]
    # Pipeline stages meet on rank 0 through a CPU gather, so only a one-stage mesh stays on the device.
    where = rank.device if on_device and rank.dims.pp == 1 else "cpu"
    weights = sync_source(rank, kind)
    if rank.dims.world_size == 1:
        return cast_copies(weights, dtype, where)        # one foreach copy, not a .to() per tensor
    if rank.gatherer is None:
        rank.gatherer = stage_gatherers(rank.layout.mesh)
    mine = rank.gatherer.gather(weights, dtype=dtype, where=where,
                                bucket_bytes=rank.settings.weight_sync.device_bucket_bytes)
    sender = rank.index != 0 and mine is not None
    parts = gather_to_rank0(mine if sender else None, rank.group)
    if parts is None:
        return None
    merged = dict(mine)
    for part in parts:
        merged.update(part or {})
    if rank.hf_config.tie_word_embeddings:
        merged.pop("lm_head.weight", None)      # the last stage's copy of the tied embedding
    if on_device:
        merged = {name: t.to(rank.device) for name, t in merged.items()}
    return merged


def export_hf(rank: Rank, path: str) -> None:
    """The actor as a Hugging Face folder at `path` (written by rank 0): safetensors, the config as loaded, and the
    model folder's other files (tokenizer, chat template, generation config, custom code)."""
    from safetensors.torch import save_file

    state = full_weights(rank)
    if rank.index != 0:
        return
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    # The config of the HF class as loaded (FSDP and pipeline stages change the live module, not it).
    rank.hf_config.save_pretrained(out)
    for f in Path(rank.model_path).iterdir():
        # Tokenizer, chat template, generation config, custom code: everything but weights and config.
        if f.is_file() and not (f.suffix in (".safetensors", ".bin", ".pt") or f.name.endswith(".index.json")
                                or f.name == "config.json"):
            shutil.copy2(f, out / f.name)
    log.info("exported actor (step %d) to %s", rank.actor.step, out)
