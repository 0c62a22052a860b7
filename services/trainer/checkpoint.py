"""Trainer checkpoints with torch.distributed.checkpoint: loadable on a different mesh shape.

Layout of a checkpoint directory:
  dcp/                 model + optimizer of the actor (and critic), keyed by parameter FQN (DCP, resharded on load)
  trainer_state.pt     schedulers, fp16 loss scalers, optimizer-step counts, weight version, the saving mesh (rank 0)
  rng/rank{r}.pt       torch RNG state of each rank (restored where the rank exists)
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

log = logging.getLogger("meshrl.trainer")

STATE_FILE = "trainer_state.pt"


def exists(path: str) -> bool:
    return (Path(path) / STATE_FILE).is_file() and (Path(path) / "dcp").is_dir()


def read_meta(path: str) -> dict:
    return torch.load(Path(path) / STATE_FILE, weights_only=False)


def _state(models: Sequence) -> dict:
    out = {}
    for m in models:
        fresh = not m.optimizer.state
        model_sd, optim_sd = get_state_dict(m.module, m.optimizer)
        if fresh:
            # get_state_dict initialises empty Adam state with a zero-lr step (step=1); undo it so a
            # checkpoint taken before the first update does not change the next update's bias correction.
            m.optimizer.state = defaultdict(dict)
        out[m.name] = {"model": model_sd, "optim": optim_sd}
    return out


def save(path: str, models: Sequence, *, weight_version: int, rank: int, world_size: int, mesh: str) -> None:
    """Collective: every rank writes its shards; rank 0 writes the small state."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    # Saving over an older checkpoint in the same directory is what a periodic "latest" save does.
    dcp.save(_state(models), storage_writer=dcp.FileSystemWriter(str(root / "dcp"), overwrite=True))
    (root / "rng").mkdir(exist_ok=True)
    torch.save(torch.get_rng_state(), root / "rng" / f"rank{rank}.pt")
    if rank == 0:
        torch.save({"weight_version": weight_version, "world_size": world_size, "mesh": mesh,
                    "has_critic": any(m.name == "critic" for m in models),
                    "models": {m.name: {"step": m.step, "scheduler": m.scheduler.state_dict(),
                                        "scaler": m.scaler.state_dict() if m.scaler is not None else None}
                               for m in models}},
                   root / STATE_FILE)
    dist.barrier()
    log.info("saved checkpoint to %s (step %d, version %d)", root, models[0].step, weight_version)


def load(path: str, models: Sequence, *, rank: int, aliases: dict[str, str] | None = None) -> int:
    """Collective: restores every model in place and returns the saved weight version.

    `aliases` maps a parameter name to another name of the same (tied) tensor: a pipeline's last stage
    keys the tied embedding's optimizer state as lm_head.weight, a one-stage run as model.embed_tokens.weight.
    """
    root = Path(path)
    meta = read_meta(path)
    saved_keys = set(dcp.FileSystemReader(str(root / "dcp")).read_metadata().state_dict_metadata)
    state = _state(models)
    # Loading into fresh optimizer state needs the initialised structure that _state just undid.
    for m in models:
        state[m.name]["optim"] = get_state_dict(m.module, m.optimizer)[1]
    own_params = {m.name: [list(g["params"]) for g in state[m.name]["optim"]["param_groups"]] for m in models}
    renamed: dict[str, dict[str, str]] = {m.name: {} for m in models}
    for m in models:
        optim_state = state[m.name]["optim"]["state"]
        for fqn in list(optim_state):
            alias = (aliases or {}).get(fqn)
            if alias and not any(k.startswith(f"{m.name}.optim.state.{fqn}.") for k in saved_keys) \
                    and alias not in optim_state:
                optim_state[alias] = optim_state.pop(fqn)
                renamed[m.name][alias] = fqn
    dcp.load(state, checkpoint_id=str(root / "dcp"))
    for m in models:
        optim_state = state[m.name]["optim"]["state"]
        for alias, fqn in renamed[m.name].items():
            optim_state[fqn] = optim_state.pop(alias)
        # Param groups are plain objects saved once (by one rank): on another mesh their FQN lists can be
        # another stage's. Keep the loaded hyper-parameters, but this rank's parameters.
        for group, params in zip(state[m.name]["optim"]["param_groups"], own_params[m.name]):
            group["params"] = params
        set_state_dict(m.module, m.optimizer, model_state_dict=state[m.name]["model"],
                       optim_state_dict=state[m.name]["optim"])
        saved = meta["models"][m.name]
        m.scheduler.load_state_dict(saved["scheduler"])
        # A checkpoint of an fp32/bf16 run resumed in fp16 starts from the configured scale.
        if m.scaler is not None and saved.get("scaler"):
            m.scaler.load_state_dict(saved["scaler"])
        m.step = int(saved["step"])
    rng = root / "rng" / f"rank{rank}.pt"
    if rng.is_file():
        torch.set_rng_state(torch.load(rng, weights_only=True))
    dist.barrier()
    log.info("loaded checkpoint %s (step %d, version %d, saved on %s)", root, models[0].step,
             meta["weight_version"], meta["mesh"])
    return int(meta["weight_version"])
