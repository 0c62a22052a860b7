"""Whether a recipe's services fit their GPUs (memory.py's estimates): `meshrl up` refuses one that cannot, with the
estimate and the settings that would make it fit, and sizes the paged KV pool where its auto size alone is too big.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Mapping, Sequence

from coordinator.recipe.memory import (DTYPE_BYTES, FIT_FRACTION, GIB, Estimate, by_gpu, estimate, gib, memory_of,
                                       keeps_paged_pool, static_kv_cache)
from coordinator.recipe.model_shape import model_shape


def _static_pool(cfg, placement: Mapping[str, Sequence[str]]):
    """(GiB, cfg with it) for the paged KV pool at what an unpaged cache of a step's rows takes, where the pool's size
    is auto (the torch engine's paged cache, no rollout.kv_cache_gib); else None."""
    r = cfg.rollout
    if not keeps_paged_pool(cfg) or r.kv_cache_gib is not None:
        return None
    static = static_kv_cache(cfg, model_shape(cfg.model.path), DTYPE_BYTES[cfg.model.dtype],
                              max(1, len(placement.get("rollout", []))))[1]
    size = max(1, -(-static // GIB))
    return size, cfg.model_copy(update={"rollout": r.model_copy(update={"kv_cache_gib": float(size)})})


def _variants(cfg, placement: Mapping[str, Sequence[str]]):
    """The settings that shrink the trainer or the rollout, as (advice, cfg, placement), in the order offered."""
    from services.trainer.config import LoraSection

    a, r = cfg.actor, cfg.rollout
    if pool := _static_pool(cfg, placement):
        yield (f"rollout.kv_cache_gib {pool[0]} (the paged KV pool at what an unpaged cache of a step's rows takes)",
               pool[1], placement)
    if a.lora is None:
        no_ref = {**placement, "reference": []}
        yield ("actor.lora.rank 16 (adapters over a frozen base; with reference.replicas 0 the trainer serves "
               "the reference)", cfg.model_copy(update={"actor": a.model_copy(update={"lora": LoraSection(rank=16)})}),
               no_ref)
        if cfg.model.dtype in ("bfloat16", "float16") and a.param_dtype in (None, "float32"):
            yield (f"actor.param_dtype {cfg.model.dtype} (no fp32 master weights: 8 bytes/param, not 16+)",
                   cfg.model_copy(update={"actor": a.model_copy(update={"param_dtype": cfg.model.dtype})}), placement)
    if a.activation_checkpointing != "full" or a.activation_checkpointing_every > 1:
        yield ("actor.activation_checkpointing full",
               cfg.model_copy(update={"actor": a.model_copy(update={"activation_checkpointing": "full",
                                                                    "activation_checkpointing_every": 1})}),
               placement)
    if a.micro_batch_token_budget > 4096:
        yield ("a smaller actor.micro_batch_token_budget (4096)",
               cfg.model_copy(update={"actor": a.model_copy(update={"micro_batch_token_budget": 4096})}), placement)
    if r.engine == "torch":
        yield ("a smaller rollout.max_batch_size (64)",
               cfg.model_copy(update={"rollout": r.model_copy(update={"max_batch_size": 64})}), placement)


def _over(cfg, placement, gpu_bytes, trainer_devices: str) -> tuple[list[Estimate], list[tuple[str, list[Estimate], int]]]:
    """The estimates, and each GPU whose sum passes FIT_FRACTION of its memory (with its processes and size)."""
    estimates = estimate(cfg, placement, trainer_devices, memory_of(gpu_bytes, "cuda:0"))
    over = []
    for gpu, group in by_gpu(estimates).items():
        size = memory_of(gpu_bytes, gpu)
        if size is not None and sum(e.total for e in group) > FIT_FRACTION * size:
            over.append((gpu, group, size))
    return estimates, over


def check_fits(cfg, placement: Mapping[str, Sequence[str]], gpu_bytes: int | Sequence[int] | Mapping[str, int],
               trainer_devices: str = "") -> list[Estimate]:
    """The estimates when every GPU's sum fits FIT_FRACTION of its memory; else ValueError with the estimate per
    service and the settings that would make it fit. gpu_bytes: one size for every GPU, or each GPU's by index."""
    estimates, over = _over(cfg, placement, gpu_bytes, trainer_devices)
    if not over:
        return estimates
    gpu, group, size = over[0]
    total = sum(e.total for e in group)
    advice = []
    for text, variant, where in _variants(cfg, placement):
        fits = not _over(variant, where, gpu_bytes, trainer_devices)[1]
        advice.append((not fits, text + ("" if fits else " (not enough alone)")))
    advice.sort(key=lambda t: t[0])   # the ones that fit alone first, each group in its order
    roles = {e.service.split()[0] for e in group}
    if "trainer" in roles and len(roles) > 1:
        alone = sum(e.total for e in group if e.service.startswith("trainer")) <= FIT_FRACTION * size
        advice.append((False, "put the trainer on its own GPU with trainer.devices (and the replicas on "
                              "others with rollout.devices / reference.devices)" + ("" if alone else
                              " (not enough alone)")))
    raise ValueError(
        f"model.path: {cfg.model.path} needs about {gib(total)} GiB on {gpu} ({'; '.join(e.describe() for e in group)})"
        f", the GPU has {gib(size)} GiB ({FIT_FRACTION:.0%}: {gib(FIT_FRACTION * size)} usable); set "
        + ", or ".join(text for _, text in advice) + " (`meshrl memory` prints the estimate)")


def gpu_memory() -> list[int] | None:
    """Total memory of each GPU (bytes, by index): nvidia-smi, else torch when it is installed; None without
    a GPU."""
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=30, check=True).stdout
            sizes = [int(float(line)) * 2**20 for line in out.split() if line.strip()]
            if sizes:
                return sizes
        except (OSError, subprocess.SubprocessError, ValueError):
            pass
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return [torch.cuda.mem_get_info(i)[1] for i in range(torch.cuda.device_count())]


def fit_auto_pool(cfg, placement: Mapping[str, Sequence[str]], gpu_bytes: int | Sequence[int] | Mapping[str, int],
                  trainer_devices: str = ""):
    """(cfg with it, {"rollout.kv_cache_gib": N}) where the paged KV pool's size is auto and the recipe does not fit
    its GPUs with the auto pool (room for max_batch_size rows, at most half the memory free: more than a one-GPU
    recipe with a long max_tokens leaves beside the trainer) but does with the pool at N GiB, what the unpaged cache
    of a step's rows would take; else (cfg, {})."""
    pool = _static_pool(cfg, placement)
    if pool is None or not _over(cfg, placement, gpu_bytes, trainer_devices)[1]:
        return cfg, {}
    if _over(pool[1], placement, gpu_bytes, trainer_devices)[1]:
        return cfg, {}       # check_fits refuses it, naming every setting that would help
    return pool[1], {"rollout.kv_cache_gib": str(pool[0])}


def check_recipe_fits(cfg, placement: Mapping[str, Sequence[str]], trainer_devices: str = "") -> dict[str, str]:
    """`meshrl up`'s check: on a CUDA model.device, the recipe's services fit the GPUs found (no GPU, no check); or
    ValueError. Returns the settings `meshrl up` passes every service in place of an auto size that would not fit
    (fit_auto_pool), which its caller says out loud."""
    if not cfg.model.device.startswith("cuda"):
        return {}
    sizes = gpu_memory()
    if not sizes:
        return {}
    cfg, fitted = fit_auto_pool(cfg, placement, sizes, trainer_devices)
    check_fits(cfg, placement, sizes, trainer_devices)
    return fitted


def fitted_line(fitted: dict[str, str]) -> str:
    """What `meshrl up` prints when fit_auto_pool sized the pool."""
    return (f"rollout.kv_cache_gib: auto -> {fitted['rollout.kv_cache_gib']} (the paged KV pool's auto size does not "
            f"fit beside the other services on its GPU; this is what the unpaged cache of a step's rows takes; "
            f"`meshrl memory` prints the estimate)")
