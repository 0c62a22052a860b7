"""Named LoRA adapters beside the run's own ("default") over the actor's one frozen base: each has its own AdamW,
lr schedule, step count, weight version and pending-gradient count, so several training-API clients train at once
on one trainer (docs/training_api.md "Several clients").

peft holds them in the same LoraLayers (`inject_adapter_in_model(config, model, adapter_name=NAME)`); a command on
a named adapter makes it the layers' active adapter for its duration (peft's `set_adapter`, which also leaves only
its parameters trainable) and the run's adapter after it, so its forward, backward, gradient clip and optimizer step
touch that adapter alone. The run's adapter, checkpoints and weight sync are unchanged: checkpoints save what
trains while the run's adapter is active (DCP `ignore_frozen_params`), and pushes of the run's weights read it by
name (model/lora.py).

Limits, refused by name: a trainer of one process (a DDP/FSDP wrapper built at start-up knows only the parameters
it had then) and no `actor.compile: true` (its graphs are specialised on the active adapter); a trainer that
`actor.compile: auto` compiled (CUDA) runs eager from its first named adapter on, and says so.
"""

from __future__ import annotations

import re
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.auto import is_auto
from services.common.errors import FailedPrecondition, NotFound
from services.common.tensors.compile import remove_compile
from services.common.tensors.codec import DTYPES
from services.common.tensors.device_staging import cast_copies
from services.trainer.model.lora import ADAPTER, adapter_state, lora_layers, merged_weights
from services.trainer.model.optim import DynamicLossScaler, build_adamw, lr_lambda
from services.trainer.model.trained import Trained

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
STATE_FILE = "adapter_state.pt"


@dataclass
class NamedAdapter:
    trained: Trained           # the actor's module and forward, this adapter's optimizer, schedule and step
    weight_version: int = 0
    pending: int = 0           # ForwardBackward calls whose gradients wait for its OptimStep


def named(rank) -> dict[str, NamedAdapter]:
    """The rank's named adapters (made on first use)."""
    if not hasattr(rank, "named_adapters"):
        rank.named_adapters = {}
    return rank.named_adapters


def check_new(rank, name: str) -> None:
    """Rank 0, before any rank runs: a named adapter this trainer can hold, or a one-line refusal naming why."""
    if rank.cfg.lora is None:
        raise FailedPrecondition("adapter: named adapters need a LoRA trainer (actor.lora); this one trains every "
                                 "weight, one client at a time")
    if rank.dims.world_size > 1:
        raise FailedPrecondition(f"adapter: named adapters run on a trainer of one process; this one has "
                                 f"{rank.dims.world_size} ({rank.dims.describe()}): its data-parallel wrapper, "
                                 f"built at start-up, holds the run's adapter only")
    if rank.compiled:
        if not is_auto(rank.settings.actor.compile):
            raise FailedPrecondition("adapter: named adapters need actor.compile: false (the compiled graphs are "
                                     "specialised on the run's adapter)")
        _go_eager(rank)
    if name == ADAPTER or not NAME.match(name):
        raise ValueError(f"name: {name!r} is not an adapter name (letters, digits, '-', '_', at most 64, not "
                         f"{ADAPTER!r}: the run's own)")
    if name in named(rank):
        raise FailedPrecondition(f"name: adapter {name!r} exists already on this trainer")


def _go_eager(rank) -> None:
    """actor.compile: auto compiled the blocks (a CUDA trainer); their graphs are specialised on the run's adapter,
    so the trainer runs eager from its first named adapter on, said in the log and GetInfo's resolved settings."""
    remove_compile(rank.actor.module)
    rank.compiled = False
    rank.resolved.record("actor.compile", False, rank.settings.actor.compile,
                         "named adapters: the compiled blocks were specialised on the run's adapter; eager from the "
                         "first named adapter on")


def get(rank, name: str) -> NamedAdapter:
    found = named(rank).get(name)
    if found is None:
        raise NotFound(f"adapter: no adapter {name!r} on this trainer (held: {sorted(named(rank)) or 'none'})")
    return found


def _activate(module, name: str) -> None:
    for layer in lora_layers(module).values():
        layer.set_adapter(name)


@contextmanager
def using(rank, name: str):
    """The Trained a command on `name` runs through ("" = the run's actor), its adapter the active one meanwhile."""
    if not name:
        yield rank.actor
        return
    adapter = get(rank, name)
    _activate(rank.actor.module, name)
    try:
        yield adapter.trained
    finally:
        _activate(rank.actor.module, ADAPTER)


def adapter_name(name: str) -> str:
    """The layers' name of a command's adapter ("" = the run's own)."""
    return name or ADAPTER


@contextmanager
def together(rank, names: list[str]):
    """The Trained of each of `names` ("" = the run's actor), every one of their adapters trainable at once for an
    update that runs them in one pass (updates/merged.py; each optimizer step reads its own optimizer's parameters).
    The run's adapter stays the layers' active one throughout; the named adapters are frozen again afterwards. Their
    parameters are their optimizers' own, so nothing walks the module (peft's set_adapter on every layer did)."""
    trained = [rank.actor if not n else get(rank, n).trained for n in names]
    try:
        _trainable(trained, True)
        yield trained
    finally:
        _trainable([t for n, t in zip(names, trained) if n], False)


def _trainable(trained: list[Trained], on: bool) -> None:
    for t in trained:
        for group in t.optimizer.param_groups:
            for p in group["params"]:
                p.requires_grad_(on)


def create(rank, name: str) -> None:
    """Injects a fresh adapter `name` with the run's LoRA settings (peft's init: A random, B zero, so it starts as
    the base) and gives it its own AdamW (command: every rank)."""
    from peft import LoraConfig, inject_adapter_in_model

    cfg, module = rank.cfg.lora, rank.actor.module
    with warnings.catch_warnings():             # "multiple adapters in the model": what this module is for
        warnings.filterwarnings("ignore", message="Already found a `peft_config`")
        inject_adapter_in_model(LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                                           target_modules=list(cfg.target_modules), bias="none"),
                                module, adapter_name=name)
    _activate(module, name)
    try:
        params = [p for n, p in module.named_parameters() if f".lora_A.{name}." in n or f".lora_B.{name}." in n]
        dtype = getattr(torch, rank.param_dtype)
        for p in params:
            p.data = p.data.to(dtype)               # adapters train in the master dtype, as the run's
        opt = rank.actor.cfg
        optimizer = build_adamw(params, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay,
                                name=f"adapter {name}")
    finally:
        _activate(module, ADAPTER)
    a = rank.settings.actor
    scaler = (DynamicLossScaler(a.loss_scale_init, growth_interval=a.loss_scale_growth_interval)
              if rank.actor.scaler is not None else None)
    trained = Trained(name, module, rank.actor.forward, optimizer, torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(opt)), opt, stages=rank.actor.stages, scaler=scaler)
    named(rank)[name] = NamedAdapter(trained)


def delete(rank, name: str) -> None:
    """Removes the adapter's layers' weights (peft's delete_adapter) and its optimizer state (command)."""
    get(rank, name)
    del named(rank)[name]
    for layer in lora_layers(rank.actor.module).values():
        layer.delete_adapter(name)
    getattr(rank.actor.module, "peft_config", {}).pop(name, None)
    _activate(rank.actor.module, ADAPTER)


@torch.no_grad()
def for_sync(rank, name: str, on_device: bool, kind: str = "adapter") -> dict[str, torch.Tensor]:
    """A push of adapter `name`, copied in the replicas' dtype (on rank 0's device for ipc and nccl), as
    weights/full.full_weights copies the run's: kind "adapter" its weights alone under peft's saved names, "full"
    the base with it merged in (for a replica whose engine serves no adapters)."""
    get(rank, name)
    module = rank.actor.module
    state = adapter_state(module, name) if kind == "adapter" else merged_weights(module, name)
    dtype = DTYPES[rank.cfg.weight_sync_dtype or rank.settings.model.dtype]
    where = rank.device if on_device else "cpu"
    return cast_copies(state, dtype, where)


def save(rank, name: str, path: str, base: dict) -> None:
    """The adapter's weights, optimizer and schedule state, step and weight version, and the base they train on
    (model/adapters.base_identity), in one file under `path` (command)."""
    adapter = get(rank, name)
    t = adapter.trained
    Path(path).mkdir(parents=True, exist_ok=True)
    torch.save({"adapter": name, "weights": {k: v.cpu() for k, v in adapter_state(t.module, name).items()},
                "optimizer": t.optimizer.state_dict(), "scheduler": t.scheduler.state_dict(), "step": t.step,
                "weight_version": adapter.weight_version, "lora_base": base,
                "lora": {"rank": rank.cfg.lora.rank, "alpha": rank.cfg.lora.alpha,
                         "target_modules": list(rank.cfg.lora.target_modules)}}, Path(path, STATE_FILE))


def read(path: str, *, base: dict, lora) -> dict:
    """Rank 0, before any rank changes: a saved adapter state over this trainer's base and LoRA shape, or refused."""
    file = Path(path, STATE_FILE)
    if not file.is_file():
        raise NotFound(f"path: {path!r} holds no saved adapter ({STATE_FILE}; SaveState of a client writes it)")
    state = torch.load(file, map_location="cpu", weights_only=True)
    if state["lora_base"]["digest"] != base["digest"]:
        raise FailedPrecondition(f"path: {path!r} holds an adapter of base {state['lora_base']['model_path']} "
                                 f"(digest {state['lora_base']['digest'][:8]}...), this trainer's base is "
                                 f"{base['model_path']} (digest {base['digest'][:8]}...)")
    shape = {"rank": lora.rank, "alpha": lora.alpha, "target_modules": list(lora.target_modules)}
    if state["lora"] != shape:
        raise FailedPrecondition(f"path: {path!r} holds an adapter of LoRA {state['lora']}, this trainer's "
                                 f"actor.lora is {shape}")
    return state


@torch.no_grad()
def load(rank, name: str, state: dict) -> None:
    """Puts a saved adapter state (`read`) into adapter `name`: weights, optimizer, schedule, step and version
    (command); gradients pending on the old weights are dropped."""
    adapter = get(rank, name)
    t = adapter.trained
    own = adapter_state(t.module, name)
    if set(own) != set(state["weights"]):
        raise FailedPrecondition(f"path: the saved adapter's tensors do not match adapter {name!r}'s layers")
    for k, v in state["weights"].items():
        own[k].copy_(v)
    t.optimizer.zero_grad(set_to_none=True)
    t.optimizer.load_state_dict(state["optimizer"])
    t.scheduler.load_state_dict(state["scheduler"])
    t.step = state["step"]
    adapter.weight_version = max(adapter.weight_version, state["weight_version"]) + 1
    adapter.pending = 0
