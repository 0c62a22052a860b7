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
from services.trainer.model import lora_mixed
from services.trainer.model.lora_group import grouped_linear
from services.trainer.model.lora_linear import adapted_linear

log = logging.getLogger("meshrl.trainer")

ADAPTER = "default"


def apply_lora(model: nn.Module, cfg: LoraSection, *, adapter_dtype: torch.dtype) -> None:
    """Injects LoRA adapters into `model` in place; only they train (in `adapter_dtype`: the master dtype)."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                        target_modules=list(cfg.target_modules), bias="none")
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    layers = lora_layers(model)
    groups = sibling_groups(model, layers)
    for name, layer in layers.items():
        layer.forward = lean_forward(layer, groups.get(name))
    trainable = 0
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
        if p.requires_grad:
            p.data = p.data.to(adapter_dtype)
            trainable += p.numel()
    for group in {id(g): g for g, _ in groups.values()}.values():
        group.fuse_bases()
    total = sum(p.numel() for p in model.parameters())
    log.info("LoRA rank %d on %s: %d of %d parameters train (%.2f%%)", cfg.rank, ",".join(cfg.target_modules),
             trainable, total, 100.0 * trainable / max(1, total))


def lean_forward(layer: nn.Module, group: tuple[SiblingGroup, int] | None = None):
    """The adapted layer's forward for training: base(x) + scaling * B(A(x)) in the compute dtype, through one op
    (services/trainer/model/lora_linear.py) whose backward never forms the frozen base's weight gradient and makes
    one pass over each [tokens, features] tensor it needs, where nn.Linear + addmm made four over the output. A
    member of a SiblingGroup (q/k/v, gate/up: `group` is it and the layer's index in it) goes through the group's one
    op (services/trainer/model/lora_group.py), which reads their shared input once.

    Why not peft's own forward: it casts the layer's input to the adapters' fp32 before A (two extra [tokens, in]
    copies per adapted layer kept for backward), and adds B's scaled output in separate passes. Installed on the
    instance: module names, state dicts and peft's other methods (merge, get_delta_weight, enable_adapters) stay.
    A layer this op does not cover (a LoRA bias, dropout, DoRA, a base that trains) keeps peft's forward. Inside
    lora_mixed.rows, each token goes through its row's adapter (several runs' updates in one pass).
    """
    base = layer.base_layer
    peft_forward = type(layer).forward.__get__(layer)
    if not isinstance(base, nn.Linear):
        return peft_forward

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if layer.disable_adapters:
            return base(x, *args, **kwargs)
        mixed = lora_mixed.active()
        if mixed is not None and not (args or kwargs):
            y = None if group is None else group[0].output(group[1], x, None, mixed)
            return lora_mixed.mixed_linear(layer, x, mixed) if y is None else y
        adapter = None if args or kwargs else lean_adapter(layer)
        if adapter is None:
            return peft_forward(x, *args, **kwargs)
        y = None if group is None else group[0].output(group[1], x, adapter)
        return adapted_linear(x, base.weight, base.bias, *adapter) if y is None else y
    return forward


def lean_adapter(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """(A, B, scaling) of the layer's active adapter, or None where the lean ops do not cover it (peft's forward)."""
    # Read per call: a trainer holding several named adapters (services/trainer/model/adapter_set.py) switches the
    # active one with peft's set_adapter.
    name = layer.active_adapters[0]
    if (not isinstance(layer.base_layer, nn.Linear) or layer.base_layer.weight.requires_grad
            or layer.lora_B[name].bias is not None or name in getattr(layer, "lora_variant", {})
            or not isinstance(layer.lora_dropout[name], nn.Identity)):
        return None
    return layer.lora_A[name].weight, layer.lora_B[name].weight, float(layer.scaling[name])


# Sibling linears a decoder calls one after another on one input, in the order it calls them (transformers' Llama,
# Qwen2/3, Mistral, Gemma, OLMo... attention and MLP forwards).
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class SiblingGroup:
    """Adapted linears of one module that read one input, first to last in the order the module calls them. The
    first (the leader) computes every member's output through one meshrl::lora_group op and leaves each other's on
    the input tensor itself, as an attribute under that member's key; a member called with that tensor takes its
    output off it. The attention and MLP forwards of transformers stay as they are (each of their shapes calls
    q/k/v on one hidden_states), and nothing outlives the input: the outputs go with it. Under torch.compile the
    stash is a side effect on a tensor made inside the traced block (the normed hidden state), which dynamo traces
    away, checkpointed blocks included (an attribute of an object from outside a checkpoint would graph-break). The
    keys are the members' names, the same in every block (dynamo guards on them: one compiled graph serves all
    blocks). A member called on another tensor, or whose output the leader did not make, computes alone."""

    def __init__(self, members: list[nn.Module], names: list[str]):
        self.members = members
        self.keys = [f"_meshrl_lora_{n}" for n in names]

    @torch.no_grad()
    def fuse_bases(self) -> None:
        """The members' frozen base weights moved into one storage, one after another (each stays its own
        Parameter, a view of it; no more memory): the group's op then runs one base GEMM for all of them
        (lora_group.stacked). Left as they are where they could not be one tensor (trained, or of other dtypes,
        devices, input widths or tensor types: a TP shard's DTensor)."""
        weights = [m.base_layer.weight for m in self.members]
        if (any(w.requires_grad or type(w) is not nn.Parameter for w in weights)
                or len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1):
            return
        fused, start = torch.cat([w.detach() for w in weights]), 0
        for m, w in zip(self.members, weights):
            m.base_layer.weight = nn.Parameter(fused[start:start + w.shape[0]], requires_grad=False)
            start += w.shape[0]

    def output(self, index: int, x: torch.Tensor, adapter: tuple | None,
               mixed: lora_mixed.MixedRows | None = None) -> torch.Tensor | None:
        """Member `index`'s output for x (its `adapter` as lean_adapter gives it; or, in a mixed pass, each token
        under its row's adapter: `mixed`), or None: it computes alone."""
        if index:
            y = getattr(x, self.keys[index], None)
            if y is not None:
                setattr(x, self.keys[index], None)
            return y
        if mixed is not None:               # lora_mixed.unmixable checked every adapted layer before the pass
            rest = [(i, m) for i, m in enumerate(self.members) if i and not m.disable_adapters]
            if not rest:
                return None
            ys = lora_mixed.mixed_group([self.members[0]] + [m for _, m in rest], x, mixed)
        else:
            rest = [(i, lean_adapter(m)) for i, m in enumerate(self.members) if i and not m.disable_adapters]
            rest = [(i, a) for i, a in rest if a is not None]
            if not rest:
                return None
            bases = [self.members[0].base_layer] + [self.members[i].base_layer for i, _ in rest]
            adapters = [adapter] + [a for _, a in rest]
            ys = grouped_linear(x, [b.weight for b in bases], [b.bias for b in bases], [a[0] for a in adapters],
                                [a[1] for a in adapters], [a[2] for a in adapters])
        for (i, _), y in zip(rest, ys[1:]):
            setattr(x, self.keys[i], y)
        return ys[0]


def sibling_groups(model: nn.Module, layers: dict[str, nn.Module]) -> dict[str, tuple[SiblingGroup, int]]:
    """{layer name: (its group, its index in it)} for the adapted linears of each module that read one input (two
    or more of a SIBLINGS set, nn.Linear bases)."""
    out = {}
    for prefix, module in model.named_modules():
        for names in SIBLINGS:
            full = [f"{prefix}.{n}" if prefix else n for n in names]
            members = [f for f in full if f in layers and isinstance(layers[f].base_layer, nn.Linear)]
            if len(members) > 1:
                group = SiblingGroup([layers[f] for f in members], [f.rpartition(".")[2] for f in members])
                out.update({f: (group, i) for i, f in enumerate(members)})
    return out


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
