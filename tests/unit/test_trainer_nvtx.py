"""NVTX phase ranges: free without CUDA, and the engine marks exactly the documented phases."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from services.common.config import load_config
from services.trainer import nvtx
from services.trainer.config import TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.testing import make_tiny_model, random_samples
from services.trainer.types import ActorLoss, CriticLoss, CriticSample


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU no-op")
def test_phases_are_a_shared_no_op_without_cuda(monkeypatch):
    def refuse(name):
        raise AssertionError(f"NVTX range {name!r} opened without CUDA")

    monkeypatch.setattr(torch.cuda.nvtx, "range", refuse)
    a, b = nvtx.phase("optimizer"), nvtx.phase("forward_backward")
    assert a is b                                   # one shared nullcontext: nothing is built per call
    with a:
        pass


def test_an_unknown_phase_name_is_refused():
    with pytest.raises(AssertionError):
        nvtx.phase("forward")


def test_the_engine_opens_the_documented_phases_around_each_step(monkeypatch, tmp_path):
    opened: list[str] = []

    @contextmanager
    def record(name):
        opened.append(name)
        yield

    monkeypatch.setattr(nvtx, "_cuda", lambda: True)
    monkeypatch.setattr(torch.cuda.nvtx, "range", record)
    model = make_tiny_model(tmp_path / "model")
    e = TrainerEngine(load_config(TrainerSettings, data={"model": {"path": model}, "actor": {"lr": 1e-3},
                                                         "critic": {}}))
    samples = random_samples(4)
    prompts, responses = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
    for s, lp in zip(samples, e.compute_logprobs(prompts, responses)):
        s.old_logprobs = lp
    assert opened == ["logprobs"]
    opened.clear()
    e.train_actor(samples, ActorLoss(mini_batch_size=2, ppo_epochs=1))
    assert opened == ["forward_backward", "optimizer"] * 2     # per mini-batch
    opened.clear()
    values = e.compute_values(prompts, responses)
    e.train_critic([CriticSample(p, r, v, v) for p, r, v in zip(prompts, responses, values)], CriticLoss())
    e.state_for_sync()
    e.save_checkpoint(str(tmp_path / "ck"))
    e.load_checkpoint(str(tmp_path / "ck"))
    e.export_hf(str(tmp_path / "hf"))
    assert opened == ["values", "forward_backward", "optimizer", "state_for_sync", "save_checkpoint",
                      "load_checkpoint", "export_hf"]
    assert set(opened) | {"logprobs"} == set(nvtx.PHASES)
