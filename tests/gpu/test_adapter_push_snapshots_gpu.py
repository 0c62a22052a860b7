"""Adapter push snapshots in the device form (ipc and nccl pushes, services/trainer/weights/snapshots.py): on a CUDA
trainer, a push asking for the adapter on the device after TrainActor gets, without waiting for the command lock,
exactly the device tensors the command path makes; a CPU-form push then falls back once and the next is a snapshot.

    PYTHONPATH=.:protos python -m pytest -q tests/gpu/test_adapter_push_snapshots_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from services.common.config import load_config
from services.trainer.config import TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.testing import make_tiny_model
from services.trainer.types import ActorLoss
from tests.unit.test_adapter_push_snapshots import LORA, SAMPLES, _equal, _push_while_locked

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_device_form_snapshots_match_the_command_path_and_a_form_change_falls_back_once(tmp_path):
    data = {"model": {"path": make_tiny_model(tmp_path / "m"), "device": "cuda", "dtype": "bfloat16"},
            "actor": {"lr": 1e-2, "shuffle": False, "compile": False, "lora": LORA}}
    engine = TrainerEngine(load_config(TrainerSettings, data=data))
    engine.create_adapter("a")
    engine.state_for_sync(True, "adapter", "a")                    # an ipc/nccl push asks for the device form
    engine.train_actor_step(SAMPLES, ActorLoss(), None, "a")
    finished, (state, version) = _push_while_locked(
        engine, "a", lambda: engine.state_for_sync(True, "adapter", "a"))
    want, want_version = engine.commands.run("adapter_for_sync", "a", True, "adapter")
    assert finished and version == want_version == 1
    assert all(t.is_cuda and t.dtype == torch.bfloat16 for t in state.values()) and _equal(state, want)
    # A grpc push (CPU form) finds no snapshot of its form: it runs the command once, which stores one.
    finished, (cpu, _) = _push_while_locked(engine, "a", lambda: engine.state_for_sync(False, "adapter", "a"))
    assert not finished and all(not t.is_cuda for t in cpu.values())
    finished, (again, version) = _push_while_locked(engine, "a", lambda: engine.state_for_sync(False, "adapter", "a"))
    assert finished and version == 1 and _equal(again, cpu)
