"""Adapter pushes from snapshots (services/trainer/weights/snapshots.py): after a change, a push of a LoRA adapter sends
exactly what the command path would, under the right version, without waiting for the trainer's command lock; a
stale snapshot falls back to the command; a stored snapshot is never written to; a deleted adapter's goes with it."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from services.common.config import load_config
from services.common.errors import NotFound
from services.trainer.config import TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.testing import make_tiny_model
from services.trainer.types import ActorLoss, TrainSample
from services.trainer.weights import snapshots
from services.trainer.weights.adapter import AdapterSync, ReplicaView
from services.trainer.weights.senders import PushOutcome

LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
SAMPLES = [TrainSample([1, 2], [5, 6, 7], [1.0, 1.0, 1.0], []), TrainSample([3], [8, 9], [-1.0, -1.0], [])]


def _engine(model: str, lr: float = 1e-2) -> TrainerEngine:
    data = {"model": {"path": model},
            "actor": {"lr": lr, "shuffle": False, "fused_logprobs": False, "lora": LORA}}
    return TrainerEngine(load_config(TrainerSettings, data=data))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("push_snapshots") / "m")


def _command_push(engine: TrainerEngine, adapter: str = "") -> tuple[dict[str, torch.Tensor], int]:
    """What today's command path sends (state_for_sync's command, run under the lock)."""
    if adapter:
        return engine.commands.run("adapter_for_sync", adapter, False, "adapter")
    return engine.commands.run("state_for_sync", False, "adapter")


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _clone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


def _push_while_locked(engine: TrainerEngine, adapter: str, push=None) -> tuple[bool, tuple | None]:
    """Holds the command lock (as a slow command would) while a push (state_for_sync of `adapter`, or `push`) runs in
    a thread: (finished while held, what it returned once the lock is free)."""
    out: list = []
    push = push or (lambda: engine.state_for_sync(False, "adapter", adapter))
    thread = threading.Thread(target=lambda: out.append(push()))
    with engine.commands._lock:
        thread.start()
        thread.join(timeout=2.0)
        finished_while_held = not thread.is_alive()
    thread.join(timeout=30.0)
    return finished_while_held, out[0] if out else None


class RecordingSender:
    """A grpc-form sender that keeps what each push sent."""

    transport, on_device = "grpc", False

    def __init__(self):
        self.sent: list[tuple[dict[str, torch.Tensor], int, object]] = []

    async def push(self, state, version, targets, *, bucket_bytes, tags=None):
        self.sent.append((dict(state), version, tags))
        return [PushOutcome(t, True) for t in targets]


def test_a_push_after_train_actor_on_a_named_adapter_sends_what_the_command_path_would(model):
    engine = _engine(model)
    engine.create_adapter("run-b")
    sender = RecordingSender()
    sync = AdapterSync(engine, sender, token=None, timeout=None)
    sync.views["replica"] = ReplicaView(True, sync.base_id)         # serves adapters over this base: no GetInfo
    asyncio.run(sync.push(["replica"], 0, "run-b"))                 # the first push asks for snapshots (CPU form)
    before = _clone(sender.sent[0][0])
    engine.train_actor_step(SAMPLES, ActorLoss(), None, "run-b")
    assert engine.adapter_version("run-b") == 1
    # No command can run meanwhile: the snapshot is sent.
    finished, _ = _push_while_locked(engine, "run-b", lambda: asyncio.run(sync.push(["replica"], 0, "run-b")))
    assert finished
    state, version, tags = sender.sent[1]
    want, want_version = _command_push(engine, "run-b")
    assert version == want_version == 1 and tags.adapter == "run-b"
    assert _equal(state, want) and not _equal(state, before)       # the trained weights, exactly, in the push dtype
    assert all(k.startswith("base_model.model.") and ".run-b." not in k for k in state)


def test_a_push_completes_while_a_command_holds_the_lock_and_waits_when_the_snapshot_is_stale(model):
    engine = _engine(model)
    engine.create_adapter("a")
    engine.state_for_sync(False, "adapter", "a")
    engine.train_actor_step(SAMPLES, ActorLoss(), None, "a")
    finished, (state, version) = _push_while_locked(engine, "a")
    assert finished and version == 1 and _equal(state, _command_push(engine, "a")[0])
    # The version moved past the snapshot (as inside a command, before it stores the new one): the push waits for
    # the command lock and then reads the weights through the command.
    engine.rank.named_adapters["a"].weight_version += 1
    finished, (state, version) = _push_while_locked(engine, "a")
    assert not finished and version == 2
    # The run's own adapter the same way.
    engine.state_for_sync(False, "adapter")
    engine.train_actor_step(SAMPLES, ActorLoss(), None)
    finished, (state, version) = _push_while_locked(engine, "")
    assert finished and version == engine.rank.weight_version == 1 and _equal(state, _command_push(engine)[0])


def test_a_pushed_snapshot_keeps_its_versions_bytes_after_later_updates(model):
    engine = _engine(model)
    engine.create_adapter("a")
    engine.state_for_sync(False, "adapter", "a")
    engine.train_actor_step(SAMPLES, ActorLoss(), None, "a")
    v1, version1 = engine.state_for_sync(False, "adapter", "a")
    kept = _clone(v1)
    engine.train_actor_step(SAMPLES, ActorLoss(), None, "a")
    v2, version2 = engine.state_for_sync(False, "adapter", "a")
    assert (version1, version2) == (1, 2)
    assert _equal(v1, kept) and not _equal(v2, kept)               # v1's tensors were not written by the update
    assert _equal(v2, _command_push(engine, "a")[0])


def test_optim_step_and_checkpoint_loads_store_snapshots_and_a_deleted_adapters_goes_with_it(model, tmp_path):
    from services.trainer.types import AdamParams, Datum, PrimitiveLoss

    engine = _engine(model)
    engine.create_adapter("a")
    engine.state_for_sync(False, "adapter", "a")
    engine.forward_backward([Datum([1, 5, 6], [5, 6, 7], weights=[1.0] * 3)], PrimitiveLoss("cross_entropy"), "a")
    engine.optim_step(AdamParams(learning_rate=1e-2, eps=1e-6), "a")
    finished, (state, version) = _push_while_locked(engine, "a")
    assert finished and version == 1 and _equal(state, _command_push(engine, "a")[0])
    # A checkpoint load may set the run's adapter to the version its snapshot has, for other weights.
    other = _engine(model, lr=5e-2)
    other.train_actor_step(SAMPLES, ActorLoss(), None)
    other.save_checkpoint(str(tmp_path / "ckpt"))
    engine.state_for_sync(False, "adapter")
    engine.train_actor_step(SAMPLES, ActorLoss(), None)
    mine, _ = engine.state_for_sync(False, "adapter")
    engine.load_checkpoint(str(tmp_path / "ckpt"))
    assert engine.rank.weight_version == 1
    finished, (state, version) = _push_while_locked(engine, "")
    assert finished and version == 1 and not _equal(state, mine)
    assert _equal(state, _command_push(engine)[0]) and _equal(state, other.state_for_sync(False, "adapter")[0])
    engine.delete_adapter("a")
    assert "a" not in snapshots.of(engine.rank).taken
    with pytest.raises(NotFound):
        engine.state_for_sync(False, "adapter", "a")
    engine.create_adapter("a")                                      # the name again: a new adapter, at version 0
    finished, (state, version) = _push_while_locked(engine, "a")
    assert finished and version == 0 and _equal(state, _command_push(engine, "a")[0])
