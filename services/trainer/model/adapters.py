"""A LoRA run's adapters as their own artifact: the base model's identity (path + digest) that checkpoints carry and
check on load, and the export in peft's own folder format (adapter_config.json + adapter_model.safetensors), which
peft's PeftModel.from_pretrained and vLLM's LoRA loading read as they are."""

from __future__ import annotations

import hashlib
import json
import logging
from functools import lru_cache
from pathlib import Path

import torch

from services.common.errors import FailedPrecondition
from services.trainer.model.lora import adapter_config, adapter_state

log = logging.getLogger("meshrl.trainer")

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# Read in 16 MiB blocks: the digest of a 1.5B bf16 folder (3 GB) takes a few seconds, once per trainer.
_BLOCK = 16 << 20


@lru_cache(maxsize=8)
def _digest(folder: str, stamp: tuple) -> str:
    h = hashlib.sha256()
    for name, _size, _mtime in stamp:
        h.update(name.encode() + b"\0")
        with open(Path(folder) / name, "rb") as f:
            while block := f.read(_BLOCK):
                h.update(block)
    return h.hexdigest()


def base_identity(model_path: str) -> dict:
    """{"model_path", "digest"}: sha256 over the base folder's config.json and weight files (names and bytes), so a
    checkpoint of adapters names the exact base they were trained on. Cached per folder state (sizes, mtimes)."""
    root = Path(model_path)
    files = sorted(f for f in root.iterdir() if f.is_file() and (
        f.name == "config.json" or f.suffix in (".safetensors", ".bin")))
    stamp = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return {"model_path": str(root.resolve()), "digest": _digest(str(root), stamp)}


def check_checkpoint_base(meta: dict, path: str, *, model_path: str, lora: bool) -> None:
    """A checkpoint of adapters loads only into a LoRA trainer over the same base (same digest); a checkpoint of
    every weight only into a trainer that trains every weight. Refused by name before anything is read."""
    if "lora_base" not in meta:              # saved before checkpoints named their base: nothing to compare
        return
    saved = meta["lora_base"]
    if saved and not lora:
        raise FailedPrecondition(f"path: checkpoint {path!r} holds LoRA adapters (base {saved['model_path']}); "
                                 f"this trainer trains every weight (no actor.lora)")
    if not saved:
        if lora:
            raise FailedPrecondition(f"path: checkpoint {path!r} holds every weight of a model; this trainer "
                                     f"trains LoRA adapters (actor.lora)")
        return
    mine = base_identity(model_path)
    if saved["digest"] != mine["digest"]:
        raise FailedPrecondition(
            f"path: checkpoint {path!r} holds LoRA adapters of base {saved['model_path']} (digest "
            f"{saved['digest'][:12]}), this trainer's base is {mine['model_path']} (digest {mine['digest'][:12]})")


def full_adapters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters under peft's saved names, whole, on CPU in fp32. Collective under FSDP (every rank calls it:
    a DTensor shard is gathered with full_tensor(), in parameter order)."""
    out = {}
    for name, t in adapter_state(module).items():
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out[name] = t.detach().to("cpu", dtype=torch.float32, copy=True).contiguous()
    return out


def write_peft_folder(path: str | Path, tensors: dict[str, torch.Tensor], config: dict, *,
                      base_digest: str | None = None) -> Path:
    """adapter_config.json + adapter_model.safetensors at `path` (created)."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt"} | ({"meshrl_base_digest": base_digest} if base_digest else {})
    save_file(tensors, str(out / WEIGHTS_FILE), metadata=meta)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")
    return out


def export_adapter(rank, path: str) -> None:
    """The actor's adapters as a peft folder at `path` (written by rank 0; every rank takes part in the gather)."""
    tensors = full_adapters(rank.actor.module)
    if rank.index != 0:
        return
    base = base_identity(rank.model_path)
    write_peft_folder(path, tensors, adapter_config(rank.cfg.lora, base["model_path"]), base_digest=base["digest"])
    log.info("exported LoRA adapters (step %d, %d tensors) to %s", rank.actor.step, len(tensors), path)
