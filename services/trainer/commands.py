"""The commands rank 0 runs on every rank: what each one runs (`COMMANDS`), the channel that carries them, and
the loop of ranks > 0.

SPMD: rank 0 checks a request (services/trainer/engine.py), broadcasts the command (name, args) on the
CommandChannel and runs it like every other rank; ranks > 0 wait in `Commands.serve`. A command is a function
`(rank, *args)` of the module that does its work (services/trainer/forward.py, weights/full.py), or one of the
few-line ones below; `COMMANDS` is the one place a name maps to it.

A command that changes a LoRA adapter's weights stores that adapter's push before it returns, so a push runs no
command (services/trainer/weights/snapshots.py lists them).
"""

from __future__ import annotations

import logging
import threading
from contextlib import nullcontext
from typing import Any, Callable

import torch
import torch.distributed as dist

from services.common.errors import FailedPrecondition, passes_through
from services.trainer import forward
from services.trainer.config import ActorConfig, CriticConfig
from services.trainer.model import adapter_set, adapters, checkpoint, fresh
from services.trainer.model.optim import apply_hyperparams
from services.trainer.nvtx import phase
from services.trainer.rank import Rank
from services.trainer.types import ActorLoss, CriticLoss, CriticSample, DPOLoss, PreferencePair, TrainSample
from services.trainer.updates.actor import ActorUpdate
from services.trainer.updates.critic import CriticUpdate
from services.trainer.updates.dpo import DPOUpdate
from services.trainer.updates import merged, primitive
from services.trainer.updates.runner import Update, run_update
from services.trainer.weights import full, snapshots

log = logging.getLogger("meshrl.trainer")


def _update(rank: Rank, update: Update) -> dict[str, float]:
    rank.pristine = False
    return run_update(update, seed=rank.cfg.seed if rank.cfg.shuffle else None, defer_last_step=rank.defer_last_step)


def train_actor(rank: Rank, samples: list[TrainSample], loss: ActorLoss, adapter: str = "") -> dict[str, float]:
    """One policy update of the actor, or of named adapter `adapter` alone (its optimizer, its weight version)."""
    with adapter_set.using(rank, adapter) as trained:
        metrics = _update(rank, ActorUpdate(rank.layout, trained, samples, loss, fused=rank.fused_logprobs))
    _updated(rank, adapter)
    return metrics


def _updated(rank: Rank, adapter: str) -> None:
    """After an update of `adapter` ("" = the run's): its new weight version, and its push stored."""
    if adapter:
        adapter_set.get(rank, adapter).weight_version += 1
    else:
        rank.weight_version += 1
    snapshots.store(rank, adapter)


def train_actors(rank: Rank, calls: list[tuple[list[TrainSample], ActorLoss, str]]) -> list[dict[str, float]]:
    """TrainActor calls that queued together (services/trainer/coalesce.py TrainMerger), each (samples, loss,
    adapter): one alone is train_actor; several, of distinct adapters, run in one pass (updates/merged.py)."""
    if len(calls) == 1:
        return [train_actor(rank, *calls[0])]
    if merged.unmergeable(rank, [adapter for _, _, adapter in calls]) is None:
        rank.pristine = False
        try:
            metrics = merged.train_together(rank, calls, seed=rank.cfg.seed if rank.cfg.shuffle else None)
        except merged.BeforeAnyStep as e:
            # One run's rows must not fail the others' updates (an out-of-memory of the bigger pass, say).
            log.warning("a merged pass for %d adapters failed before any step (%s); each runs alone", len(calls),
                        e.__cause__)
            return [_alone(rank, call) for call in calls]
        if rank.index == 0:
            log.info("one pass for %d adapters' updates (%s; %d rows)", len(calls),
                     ", ".join(a or "the run's" for _, _, a in calls), sum(len(s) for s, _, _ in calls))
        for _, _, adapter in calls:
            _updated(rank, adapter)
        return metrics
    return [_alone(rank, call) for call in calls]


def _alone(rank: Rank, call: tuple) -> dict[str, float] | Exception:
    """One call of a batch that cannot run in one pass: its metrics, or its own error (the others still run)."""
    try:
        return train_actor(rank, *call)
    except Exception as e:  # noqa: BLE001 - that call's answer (coalesce.TrainMerger hands it over)
        return e


def train_dpo(rank: Rank, pairs: list[PreferencePair], loss: DPOLoss) -> dict[str, float]:
    metrics = _update(rank, DPOUpdate(rank.layout, rank.actor, pairs, loss, fused=rank.fused_logprobs))
    rank.weight_version += 1
    snapshots.store(rank)
    return metrics


def train_critic(rank: Rank, samples: list[CriticSample], loss: CriticLoss) -> dict[str, float]:
    return _update(rank, CriticUpdate(rank.layout, rank.critic, samples, loss))


def start_from_model(rank: Rank) -> None:
    """A run starts from the model path: every model's weights as at the trainer's start, optimizer state cleared,
    under a weight version no replica holds yet."""
    for trained in rank.models():
        fresh.restore_weights(trained, rank.initial[trained.name], rank.param_dtype)
        fresh.clear_optimizer(trained, rank.settings.actor)
    rank.weight_version += 1
    rank.pristine = True
    snapshots.store(rank)


def start_from_checkpoint(rank: Rank, path: str) -> None:
    """A run starts from a checkpoint's weights, optimizer state cleared, under a weight version past both the
    trainer's and the checkpoint's (a replica may hold either for other weights)."""
    before = rank.weight_version
    _load_checkpoint(rank, path)
    for trained in rank.models():
        fresh.clear_optimizer(trained, rank.settings.actor)
    rank.weight_version = max(before, rank.weight_version) + 1
    snapshots.store(rank)


def configure_run(rank: Rank, actor: ActorConfig, critic: CriticConfig | None, reset_schedule: bool) -> None:
    """A run's sections (checked on rank 0) on this rank's models: their optimizers take the run's hyperparameters
    and lr schedule and keep their moments."""
    for trained, cfg in zip(rank.models(), (actor, critic)):
        trained.cfg = cfg
        apply_hyperparams(trained.optimizer, trained.scheduler, cfg, reset_schedule=reset_schedule)


def configure_adapter(rank: Rank, adapter: str, actor: ActorConfig, reset_schedule: bool) -> None:
    """A concurrent run's optimizer settings on its named adapter's optimizer (checked on rank 0)."""
    trained = adapter_set.get(rank, adapter).trained
    trained.cfg = actor
    apply_hyperparams(trained.optimizer, trained.scheduler, actor, reset_schedule=reset_schedule)


@torch.no_grad()
def adapter_logprobs(rank: Rank, prompts, responses, temperature: float, spans: list[tuple[str, int]]):
    """Log-probs of calls merged on rank 0 (coalesce.AdapterCoalescer), each span (adapter, rows) of the rows under
    its adapter ("" = the run's): one adapter's as before (made the layers' active adapter), several in one forward
    where the trainer can mix them (updates/merged.py), else one adapter's rows after another's."""
    names = list(dict.fromkeys(a for a, _ in spans))
    if len(names) > 1 and merged.unmergeable(rank, names) is None:
        of_row = [names.index(a) for a, n in spans for _ in range(n)]
        return forward.actor_logprobs(rank, prompts, responses, temperature,
                                      ([adapter_set.adapter_name(a) for a in names], of_row))
    out, start = [], 0
    for adapter, n in spans:
        with adapter_set.using(rank, adapter):
            part = forward.actor_logprobs(rank, prompts[start:start + n], responses[start:start + n], temperature)
        out = None if part is None else out + part              # None: a rank > 0
        start += n
    return out


def save_checkpoint(rank: Rank, path: str, weight_version: int) -> None:
    # Under LoRA the checkpoint holds the adapters only: it names the base they train on (rank 0 writes the meta).
    base = adapters.base_identity(rank.model_path) if rank.cfg.lora and rank.index == 0 else None
    checkpoint.save(path, rank.models(), weight_version=weight_version, rank=rank.index,
                    world_size=rank.dims.world_size, mesh=rank.dims.describe(), lora_base=base)


def load_checkpoint(rank: Rank, path: str) -> None:
    _load_checkpoint(rank, path)
    # Stored whatever the version: a checkpoint's may equal the one before the load, for other weights.
    snapshots.store(rank)


def _load_checkpoint(rank: Rank, path: str) -> None:
    aliases = {"lm_head.weight": "model.embed_tokens.weight"} if rank.hf_config.tie_word_embeddings else {}
    rank.weight_version = checkpoint.load(path, rank.models(), rank=rank.index, aliases=aliases)
    rank.pristine = False
    for trained in rank.models():
        # Gradients a training-API client accumulated belong to the weights before the load: a step drops them.
        trained.optimizer.zero_grad(set_to_none=True)


def optim_step(rank: Rank, actor_cfg: ActorConfig, adapter: str = "") -> dict[str, float]:
    metrics = primitive.optim_step(rank, actor_cfg, adapter)
    snapshots.store(rank, adapter)
    return metrics


def create_adapter(rank: Rank, name: str) -> None:
    adapter_set.create(rank, name)
    snapshots.store(rank, name)                 # its initial state (the base: B = 0), version 0


def load_adapter(rank: Rank, name: str, state: dict) -> None:
    adapter_set.load(rank, name, state)
    snapshots.store(rank, name)


def delete_adapter(rank: Rank, name: str) -> None:
    adapter_set.delete(rank, name)
    snapshots.drop(rank, name)


def state_for_sync(rank: Rank, on_device: bool = False, kind: str = "full") -> tuple[dict | None, int]:
    """A push's state (weights/full.py) and its version, read in the command (no update lands between them); of kind
    "adapter", also kept as the run's adapter's snapshot."""
    state = full.full_weights(rank, on_device, kind)
    if kind == "adapter" and state is not None:
        snapshots.keep(rank, "", state, on_device)
    return state, rank.weight_version


def adapter_for_sync(rank: Rank, name: str, on_device: bool, kind: str = "adapter") -> tuple[dict, int]:
    """A named adapter's push (model/adapter_set.py) and its version; of kind "adapter", also kept as its snapshot."""
    state = adapter_set.for_sync(rank, name, on_device, kind)
    if kind == "adapter":
        snapshots.keep(rank, name, state, on_device)
    return state, adapter_set.get(rank, name).weight_version


# The commands rank 0 broadcasts and every rank runs: the channel carries the name, this table is the one place a
# name maps to code.
COMMANDS: dict[str, Callable[..., Any]] = {
    "warm_up": forward.warm_up, "compute_logprobs": forward.compute_logprobs,
    "compute_values": forward.compute_values, "train_actor": train_actor,
    "train_actors": train_actors, "train_dpo": train_dpo,
    "train_critic": train_critic, "configure_run": configure_run, "configure_adapter": configure_adapter,
    "adapter_logprobs": adapter_logprobs, "state_for_sync": state_for_sync,
    "save_checkpoint": save_checkpoint, "load_checkpoint": load_checkpoint, "export_hf": full.export_hf,
    "export_adapter": adapters.export_adapter,
    "start_from_model": start_from_model, "start_from_checkpoint": start_from_checkpoint,
    # The training API's primitives (docs/training_api.md): gradients accumulate over calls, a step applies them.
    "forward_backward": primitive.forward_backward, "optim_step": optim_step,
    # Named adapters beside the run's (several training-API clients; services/trainer/model/adapter_set.py).
    "create_adapter": create_adapter, "delete_adapter": delete_adapter,
    "adapter_for_sync": adapter_for_sync, "save_adapter": adapter_set.save, "load_adapter": load_adapter}

# Commands that are one profiling phase as a whole (nvtx.PHASES); training commands mark forward_backward and
# optimizer inside.
COMMAND_PHASES = {"compute_logprobs": "logprobs", "adapter_logprobs": "logprobs", "compute_values": "values",
                  "state_for_sync": "state_for_sync",
                  "export_hf": "export_hf", "export_adapter": "export_hf", "save_checkpoint": "save_checkpoint", "load_checkpoint": "load_checkpoint"}


class CommandChannel:
    """Rank 0 broadcasts each command (name, args) to every rank; the others block in `receive`. The rank's object
    group carries the pickled commands (services/trainer/parallel/mesh.py object_group)."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def send(self, command: Any) -> None:
        assert self.rank == 0, "only rank 0 issues commands"
        if self.world_size > 1:
            dist.broadcast_object_list([command], src=0, group=self.group)

    def receive(self) -> Any:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


class Commands:
    """Runs commands on every rank: `run` on rank 0 (broadcast, then here), `serve` on the others."""

    def __init__(self, rank: Rank):
        self.rank = rank
        self.channel = CommandChannel(rank.group)
        self._lock = threading.Lock()
        self._closed = False

    def run(self, name: str, *args) -> Any:
        """Broadcasts the command and runs it here too; the lock keeps every rank's command order equal."""
        return self.run_built(name, lambda: args)

    def run_built(self, name: str, build: Callable[[], tuple]) -> Any:
        """run() with the args built once the lock is held: what queued for it meanwhile can join the command
        (services/trainer/coalesce.py). build runs whenever the lock was taken, even on a shut-down trainer."""
        with self._lock:
            args = build()
            if self._closed:
                raise FailedPrecondition("trainer is shut down")
            self.channel.send((name, args))
            return self._local(name, args)

    def _local(self, name: str, args) -> Any:
        """Runs a command on this rank, inside its NVTX range where it is one phase."""
        with phase(COMMAND_PHASES[name]) if name in COMMAND_PHASES else nullcontext():
            return COMMANDS[name](self.rank, *args)

    def serve(self) -> None:
        """The loop of ranks > 0: run each command rank 0 broadcasts until it says shutdown."""
        while True:
            name, args = self.channel.receive()
            if name == "shutdown":
                return
            try:
                self._local(name, args)
            except BaseException as e:  # noqa: BLE001 - rank 0 validated the input; keep serving and say why
                if passes_through(e):
                    raise
                log.exception("Rank %d: command %s failed", self.rank.index, name)

    def close(self) -> None:
        """Releases ranks > 0 from their loop; no command runs afterwards."""
        with self._lock:
            if not self._closed and self.rank.index == 0:
                self.channel.send(("shutdown", ()))
            self._closed = True
