"""Master weights: model.dtype bfloat16 trains fp32 parameters and AdamW state with bf16 compute unless
actor.param_dtype asks for bf16 only; replicas and ExportHF still get the model's dtype."""

from __future__ import annotations

import pytest
import torch

from services.common.config import load_config
from services.common.tensors.weights import named_weights
from services.trainer.config import ActorConfig, TrainerSettings, master_and_compute_dtypes
from services.trainer.engine import TrainerEngine
from services.trainer.testing import make_tiny_model, random_samples
from services.trainer.types import ActorLoss


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("master") / "model")


def engine(model_path: str, **actor) -> TrainerEngine:
    data = {"model": {"path": model_path, "dtype": "bfloat16"}, "actor": {"lr": 1e-2, **actor}}
    return TrainerEngine(load_config(TrainerSettings, data=data))


@pytest.mark.parametrize("actor,model_dtype,want", [
    ({}, "bfloat16", ("float32", "bfloat16")), ({}, "float16", ("float32", "float16")),
    ({}, "float32", ("float32", "float32")), ({"param_dtype": "bfloat16"}, "bfloat16", ("bfloat16", "bfloat16")),
    ({"param_dtype": "bfloat16"}, "float32", ("bfloat16", "bfloat16")),
    ({"dtype": "bfloat16"}, "float32", ("float32", "bfloat16"))])
def test_master_and_compute_dtypes(actor, model_dtype, want):
    assert master_and_compute_dtypes(ActorConfig(**actor), model_dtype) == want


def step(e: TrainerEngine):
    samples = random_samples(4, seed=2)
    lps = e.compute_logprobs([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    for s, lp in zip(samples, lps):
        s.old_logprobs = lp
    return e.train_actor(samples, ActorLoss())


def test_bf16_model_trains_fp32_master_weights_and_adam_state_and_syncs_bf16(model_path, tmp_path):
    e = engine(model_path)
    assert (e.rank.param_dtype, e.rank.compute_dtype) == ("float32", "bfloat16") and e.rank.layout.autocast
    step(e)
    assert {p.dtype for p in e.rank.actor.module.parameters()} == {torch.float32}
    states = [s for s in e.rank.actor.optimizer.state.values()]
    assert states and {s["exp_avg"].dtype for s in states} == {torch.float32}
    synced, _ = e.state_for_sync()
    assert {t.dtype for t in synced.values()} == {torch.bfloat16}
    e.export_hf(str(tmp_path / "hf"))
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(tmp_path / "hf" / "model.safetensors").values()} == {torch.bfloat16}


def test_an_update_below_bf16_resolution_moves_fp32_master_weights_but_not_bf16_only_ones(model_path):
    # AdamW's first step moves each weight by about lr; 1e-6 is far below bf16's spacing near weights of ~0.02.
    master, bf16 = engine(model_path, lr=1e-6), engine(model_path, lr=1e-6, param_dtype="bfloat16")
    assert {p.dtype for p in bf16.rank.actor.module.parameters()} == {torch.bfloat16}
    before_m = {k: v.detach().clone() for k, v in named_weights(master.rank.actor.module).items()}
    before_b = {k: v.detach().clone() for k, v in named_weights(bf16.rank.actor.module).items()}
    step(master), step(bf16)
    moved_m = sum(int((v != before_m[k]).sum()) for k, v in named_weights(master.rank.actor.module).items())
    moved_b = sum(int((v != before_b[k]).sum()) for k, v in named_weights(bf16.rank.actor.module).items())
    total = sum(v.numel() for v in before_m.values())
    assert moved_m == total
    assert moved_b < 0.05 * total
