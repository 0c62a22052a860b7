"""LoRA through peft: adapters injected in place into the Hugging Face model (its class, forward and config
stay), the base weights frozen, the merged weights for replicas and export, the adapters on and off.

Names: peft moves a target layer's weight to `<layer>.base_layer.weight` and adds `<layer>.lora_A.default.weight`
and `<layer>.lora_B.default.weight`. `merged_weights` gives back the model's own names, each target weight
being base + (alpha / rank) * B @ A, so a replica or an exported folder sees a plain model.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch
from torch import nn

from services.common.tensors.weights import named_weights
from services.trainer.config import LoraSection
from services.trainer.model.lora_linear import adapted_linear

log = logging.getLogger("meshrl.trainer")

ADAPTER = "default"


def apply_lora(model: nn.Module, cfg: LoraSection, *, adapter_dtype: torch.dtype) -> None:
    """Injects LoRA adapters into `model` in place; only they train (in `adapter_dtype`: the master dtype)."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                        target_modules=list(cfg.target_modules), bias="none")
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for layer in lora_layers(model).values():
        layer.forward = lean_forward(layer)
    trainable = 0
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
        if p.requires_grad:
            p.data = p.data.to(adapter_dtype)
            trainable += p.numel()
    total = sum(p.numel() for p in model.parameters())
    log.info("LoRA rank %d on %s: %d of %d parameters train (%.2f%%)", cfg.rank, ",".join(cfg.target_modules),
             trainable, total, 100.0 * trainable / max(1, total))


def lean_forward(layer: nn.Module):
    """The adapted layer's forward for training: base(x) + scaling * B(A(x)) in the compute dtype, through one op
    (services/trainer/model/lora_linear.py) whose backward never forms the frozen base's weight gradient and makes
    one pass over each [tokens, features] tensor it needs, where nn.Linear + addmm made four over the output.

    Why not peft's own forward: it casts the layer's input to the adapters' fp32 before A (two extra [tokens, in]
    copies per adapted layer kept for backward), and adds B's scaled output in separate passes. Installed on the
    instance: module names, state dicts and peft's other methods (merge, get_delta_weight, enable_adapters) stay.
    A layer this op does not cover (a LoRA bias, dropout, DoRA, a base that trains) keeps peft's forward.
    """
    base = layer.base_layer
    peft_forward = type(layer).forward.__get__(layer)
    if not isinstance(base, nn.Linear):
        return peft_forward

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if layer.disable_adapters:
            return base(x, *args, **kwargs)
        # The layer's active adapter, read per call: a trainer holding several named adapters
        # (services/trainer/model/adapter_set.py) switches it with peft's set_adapter.
        name = layer.active_adapters[0]
        if (args or kwargs or base.weight.requires_grad or layer.lora_B[name].bias is not None
                or name in getattr(layer, "lora_variant", {}) or not isinstance(layer.lora_dropout[name], nn.Identity)):
            return peft_forward(x, *args, **kwargs)
        return adapted_linear(x, base.weight, base.bias, layer.lora_A[name].weight, layer.lora_B[name].weight,
                              float(layer.scaling[name]))
    return forward


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def has_lora(model: nn.Module) -> bool:
    return bool(lora_layers(model))


def set_adapters(model: nn.Module, enabled: bool) -> None:
    for m in lora_layers(model).values():
        m.enable_adapters(enabled)


@contextmanager
def adapters_off(model: nn.Module):
    """The base model (the reference policy) for the duration; adapters back on afterwards."""
    set_adapters(model, False)
    try:
        yield
    finally:
        set_adapters(model, True)


def hf_name(name: str) -> str:
    return name.replace(".base_layer.", ".")


@torch.no_grad()
def merged_weights(model: nn.Module, adapter: str = ADAPTER) -> dict[str, torch.Tensor]:
    """The model's weights under its own names with `adapter` (the run's by default) merged in (nothing is changed
    in place)."""
    layers = lora_layers(model)
    out: dict[str, torch.Tensor] = {}
    for name, t in named_weights(model).items():
        if ".lora_" in name:
            continue
        layer, _, leaf = name.rpartition(".base_layer.")
        if leaf == "weight" and layer in layers:
            delta = layers[layer].get_delta_weight(adapter)
            t = t + delta.to(t.dtype)
        out[hf_name(name)] = t
    return out


def adapter_state(model: nn.Module, adapter: str = ADAPTER) -> dict[str, torch.Tensor]:
    """One adapter's weights under peft's saved names (`base_model.model.<layer>.lora_A.weight`)."""
    return {"base_model.model." + name.replace(f".{adapter}.", "."): p.detach()
            for name, p in model.named_parameters() if f".lora_A.{adapter}." in name or f".lora_B.{adapter}." in name}


def adapter_config(cfg: LoraSection, base_path: str) -> dict:
    """peft's adapter_config.json for the saved adapters (peft's PeftModel.from_pretrained loads the folder)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank, "lora_alpha": cfg.alpha,
            "lora_dropout": cfg.dropout, "target_modules": list(cfg.target_modules), "bias": "none",
            "base_model_name_or_path": base_path, "inference_mode": True}


def base_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The frozen base under the model's own names, adapters left out (not merged): what a rollout replica that
    serves adapters needs under them (services/trainer/weights/adapter.py)."""
    return {hf_name(name): t for name, t in named_weights(model).items() if ".lora_" not in name}


def adapter_sync_config(cfg: LoraSection) -> dict:
    """The adapter config a weight push carries (WeightManifest.adapter_config): what a replica needs to serve it."""
    return {"r": cfg.rank, "lora_alpha": cfg.alpha, "target_modules": list(cfg.target_modules)}
