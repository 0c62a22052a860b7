"""A run's start on a trainer that may have trained before: each model's weights back to what the trainer started
with, its optimizer state, schedule, step count and fp16 loss scale cleared.

What a model started with is two parts (`Initial`): the weights its Hugging Face folder holds, read again from the
folder (nothing of the size of the model is kept in memory), and the few the trainer made itself at start-up (LoRA
adapters, the critic's value head), kept as copies of this rank's part. The folder's full tensors go onto the
mesh through torch's distributed state-dict API (`set_model_state_dict`), which shards them as each parameter is
(FSDP, TP, one pipeline stage's modules, or a plain tensor on one process).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from services.common.tensors.codec import DTYPES
from services.common.tensors.modeling import load_causal_lm
from services.trainer.config import ActorConfig
from services.trainer.model.optim import DynamicLossScaler
from services.trainer.model.trained import Trained

log = logging.getLogger("meshrl.trainer")

# Wrapper prefixes in parameter names that torch's state-dict API leaves out of the names it matches.
_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.")


def _clean(name: str) -> str:
    for prefix in _WRAPPERS:
        name = name.replace(prefix, "")
    return name


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter (the local shard of a DTensor), writable in place."""
    return p._local_tensor if hasattr(p, "_local_tensor") else p.data


@dataclass
class Initial:
    """A model's weights at the trainer's start: the trained ones `folder` holds (None: it holds none of them, as
    under LoRA, where only the adapters train) and local copies of the trained ones it does not (`kept`)."""

    folder: str | None
    # (folder, master dtype) -> the folder's full state dict under the module's own parameter names.
    read: Callable[[str, str], dict[str, torch.Tensor]] | None = None
    kept: dict[str, torch.Tensor] = field(default_factory=dict)


def actor_state(folder: str, param_dtype: str) -> dict[str, torch.Tensor]:
    """The actor's weights as the trainer loaded them at start-up: the causal LM of the folder, in the master dtype."""
    return load_causal_lm(folder, dtype=param_dtype).state_dict()


def critic_state(folder: str, param_dtype: str) -> dict[str, torch.Tensor]:
    """The critic's backbone weights under the value model's names (its `model.` submodule)."""
    from transformers import AutoModel

    backbone = AutoModel.from_pretrained(folder, dtype=DTYPES[param_dtype], local_files_only=True)
    return {f"model.{k}": v for k, v in backbone.state_dict().items()}


def keep_initial(trained: Trained, folder: str | None, read, *, folder_holds: Callable[[str], bool]) -> Initial:
    """What `trained` starts from: copies of this rank's part of each trained weight `folder_holds` says no."""
    kept = {n: _local(p).detach().to("cpu", copy=True) for n, p in trained.module.named_parameters()
            if p.requires_grad and not (folder and folder_holds(_clean(n)))}
    return Initial(folder, read if folder else None, kept)


@torch.no_grad()
def restore_weights(trained: Trained, initial: Initial, param_dtype: str) -> None:
    """Collective (every rank, same order): the model's weights back to `initial`."""
    if initial.folder is not None:
        state = initial.read(initial.folder, param_dtype)
        kept = {_clean(n) for n in initial.kept}
        result = set_model_state_dict(trained.module, state,
                                      options=StateDictOptions(full_state_dict=True, strict=False))
        missing = sorted(k for k in map(_clean, result.missing_keys) if k not in kept)
        if missing:
            raise ValueError(f"model.path: {initial.folder!r} holds no weights for {trained.name} "
                             f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
    params = dict(trained.module.named_parameters())
    for name, value in initial.kept.items():
        _local(params[name]).copy_(value)


def clear_optimizer(trained: Trained, actor: ActorConfig) -> None:
    """No moments, no gradients, the schedule at step 0 and the loss scale at its start: as a fresh trainer's."""
    trained.optimizer.state = defaultdict(dict)
    trained.optimizer.zero_grad(set_to_none=True)
    trained.scheduler.last_epoch = 0
    trained.step = 0
    if trained.scaler is not None:
        trained.scaler = DynamicLossScaler(actor.loss_scale_init, growth_interval=actor.loss_scale_growth_interval)
