"""On a CUDA GPU: activation checkpointing lowers the actor step's peak memory and leaves its loss as it was,
fp32 master weights train under bf16 compute, and a LoRA actor (bf16 base, fp32 adapters) trains and answers
the base model's log-probs as the reference. Skipped without CUDA:

    PYTHONPATH=.:protos python -m pytest -q tests/gpu/test_trainer_memory_features.py
"""

from __future__ import annotations

import pytest
import torch

from services.common.config import load_config
from services.trainer.config import TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.testing import make_tiny_model, random_samples
from services.trainer.types import ActorLoss

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("gpu_mem") / "model", num_hidden_layers=8, vocab_size=4096)


def engine(model_path: str, **actor) -> TrainerEngine:
    data = {"model": {"path": model_path, "device": "cuda", "dtype": "bfloat16"},
            "actor": {"lr": 1e-4, "compile": False, **actor}}
    return TrainerEngine(load_config(TrainerSettings, data=data))


def step(e: TrainerEngine) -> tuple[dict, int]:
    samples = random_samples(16, vocab_size=4096, max_prompt=24, max_response=40, seed=5)
    lps = e.compute_logprobs([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    for s, lp in zip(samples, lps):
        s.old_logprobs = lp
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    metrics = e.train_actor(samples, ActorLoss())
    return metrics, torch.cuda.max_memory_allocated()


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_modes_on_cuda(model_path, mode):
    off_metrics, off_peak = step(engine(model_path))
    on = engine(model_path, activation_checkpointing=mode)
    assert (on.rank.param_dtype, on.rank.compute_dtype) == ("float32", "bfloat16")
    on_metrics, on_peak = step(on)
    assert on_metrics["pg_loss"] == pytest.approx(off_metrics["pg_loss"], abs=1e-2)
    assert on_peak < off_peak


def test_a_lora_actor_trains_on_cuda_and_its_reference_is_the_base(model_path):
    e = engine(model_path, lora={"rank": 8}, lr=1e-3)
    samples = random_samples(4, vocab_size=4096, seed=6)
    base = e.compute_logprobs([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    metrics, _ = step(e)
    assert metrics["grad_norm"] > 0
    ref = e.compute_reference_logprobs([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    for r, b in zip(ref, base):
        assert r == pytest.approx(b, abs=1e-3)
