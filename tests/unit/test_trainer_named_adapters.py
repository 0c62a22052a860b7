"""Named LoRA adapters on one trainer (services/trainer/model/adapter_set.py): each adapter's ForwardBackward and
OptimStep touch its own weights, gradients and Adam moments alone; interleaved training equals each trained alone;
the run's adapter is untouched; save/load round-trips; what cannot be honoured is refused by name."""

from __future__ import annotations

import pytest
import torch

from services.common.config import load_config
from services.common.errors import FailedPrecondition, NotFound
from services.common.tensors.compile import apply_compile, transformer_blocks
from services.trainer.config import TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.model.lora import adapter_state
from services.trainer.testing import make_tiny_model
from services.trainer.types import AdamParams, Datum, PrimitiveLoss

LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
ADAM = AdamParams(learning_rate=1e-2, eps=1e-6)
CE = PrimitiveLoss("cross_entropy")


def _engine(tmp_path, **actor) -> TrainerEngine:
    data = {"model": {"path": make_tiny_model(tmp_path / "m")},
            "actor": {"lr": 1e-3, "shuffle": False, "fused_logprobs": False, "lora": LORA, **actor}}
    return TrainerEngine(load_config(TrainerSettings, data=data))


def _datum(tokens: list[int]) -> Datum:
    return Datum(tokens[:-1], tokens[1:], weights=[1.0] * (len(tokens) - 1))


DATA_A = [[_datum([1, 5, 6, 7, 8]), _datum([1, 4, 4, 9])], [_datum([2, 3, 3, 3, 11, 12])]]
DATA_B = [[_datum([1, 20, 21, 22])], [_datum([3, 7, 9, 11, 13]), _datum([1, 2])]]


def _weights(engine: TrainerEngine, name: str) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in adapter_state(engine.rank.actor.module, name).items()}


def _moments(engine: TrainerEngine, name: str) -> list[torch.Tensor]:
    opt = (engine.rank.named_adapters[name].trained if name != "default" else engine.rank.actor).optimizer
    return [t.clone() for p in opt.param_groups[0]["params"] for t in (opt.state[p]["exp_avg"],
                                                                         opt.state[p]["exp_avg_sq"])]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 0.0) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=atol, rtol=0) for k in a)


def _set(engine: TrainerEngine, name: str, weights: dict[str, torch.Tensor]) -> None:
    own = adapter_state(engine.rank.actor.module, name)
    with torch.no_grad():
        for k, v in weights.items():
            own[k.replace(".a_.", ".")].copy_(v)


def test_a_step_of_one_adapter_leaves_the_others_weights_and_moments_and_the_run_adapter_unchanged(tmp_path):
    engine = _engine(tmp_path)
    run_logprobs = engine.compute_logprobs([[1]], [[5, 6, 7]])
    engine.create_adapter("a")
    engine.create_adapter("b")
    assert engine.info()["named_adapters"] == "a,b"
    # A new adapter is inactive: the run's forward is the same.
    assert engine.compute_logprobs([[1]], [[5, 6, 7]]) == run_logprobs
    engine.forward_backward(DATA_A[0], CE, "a")
    engine.optim_step(ADAM, "a")
    a_weights, a_moments, run = _weights(engine, "a"), _moments(engine, "a"), _weights(engine, "default")
    engine.forward_backward(DATA_A[1], CE, "a")              # a's gradients wait while b trains
    a_grads = [p.grad.clone() for p in engine.rank.named_adapters["a"].trained.optimizer.param_groups[0]["params"]]
    engine.forward_backward(DATA_B[0], CE, "b")
    metrics = engine.optim_step(ADAM, "b")
    assert metrics["grad_norm"] > 0 and metrics["skipped"] == 0.0
    assert _same(_weights(engine, "a"), a_weights)
    assert all(torch.equal(x, y) for x, y in zip(_moments(engine, "a"), a_moments))
    assert all(torch.equal(p.grad, g) for p, g in zip(
        engine.rank.named_adapters["a"].trained.optimizer.param_groups[0]["params"], a_grads))
    assert _same(_weights(engine, "default"), run)
    assert engine.compute_logprobs([[1]], [[5, 6, 7]]) == run_logprobs
    assert engine.adapter_progress("a") == (1, 1) and engine.adapter_progress("b") == (1, 1)
    assert engine.adapter_progress("") == (0, 0)


def test_interleaved_training_equals_each_adapter_trained_alone(tmp_path):
    engine = _engine(tmp_path)
    for name in ("a", "b", "a_", "b_"):
        engine.create_adapter(name)
    start_a, start_b = _weights(engine, "a"), _weights(engine, "b")
    _set(engine, "a_", start_a)
    _set(engine, "b_", start_b)
    # Interleaved: a and b's calls alternate, each accumulating over two batches before its step; one's step
    # lands between the other's two ForwardBackward calls on odd steps.
    for step in range(3):
        engine.forward_backward(DATA_A[0], CE, "a")
        engine.forward_backward(DATA_B[0], CE, "b")
        if step % 2:
            engine.forward_backward(DATA_B[1], CE, "b")
            engine.optim_step(ADAM, "b")
            engine.forward_backward(DATA_A[1], CE, "a")
            engine.optim_step(ADAM, "a")
        else:
            engine.forward_backward(DATA_A[1], CE, "a")
            engine.optim_step(ADAM, "a")
            engine.forward_backward(DATA_B[1], CE, "b")
            engine.optim_step(ADAM, "b")
    assert not _same(_weights(engine, "a"), start_a, atol=1e-4)
    # Alone: a_ trains its whole course, then b_.
    for name, data in (("a_", DATA_A), ("b_", DATA_B)):
        for _ in range(3):
            engine.forward_backward(data[0], CE, name)
            engine.forward_backward(data[1], CE, name)
            engine.optim_step(ADAM, name)
    assert _same(_weights(engine, "a"), _weights(engine, "a_"), atol=1e-6)
    assert _same(_weights(engine, "b"), _weights(engine, "b_"), atol=1e-6)


def test_save_and_load_a_named_adapter_round_trip(tmp_path):
    engine = _engine(tmp_path)
    engine.create_adapter("a")
    engine.forward_backward(DATA_A[0], CE, "a")
    engine.optim_step(ADAM, "a")
    saved_weights, saved_moments = _weights(engine, "a"), _moments(engine, "a")
    out = engine.save_checkpoint(str(tmp_path / "ck"), "a")
    assert out["step"] == 1 and out["weight_version"] == 1
    engine.forward_backward(DATA_A[1], CE, "a")
    engine.optim_step(ADAM, "a")
    assert not _same(_weights(engine, "a"), saved_weights)
    engine.create_adapter("other")
    loaded = engine.load_checkpoint(str(tmp_path / "ck"), None, "other")
    assert _same(_weights(engine, "other"), saved_weights)
    assert all(torch.equal(x, y) for x, y in zip(_moments(engine, "other"), saved_moments))
    assert loaded["step"] == 1 and loaded["weight_version"] > 1
    with pytest.raises(NotFound, match="holds no saved adapter"):
        engine.load_checkpoint(str(tmp_path), None, "other")


def test_delete_frees_the_adapter_and_its_state(tmp_path):
    engine = _engine(tmp_path)
    before = sum(p.numel() for p in engine.rank.actor.module.parameters())
    engine.create_adapter("a")
    assert sum(p.numel() for p in engine.rank.actor.module.parameters()) > before
    engine.delete_adapter("a")
    assert sum(p.numel() for p in engine.rank.actor.module.parameters()) == before
    assert engine.adapter_names() == []
    with pytest.raises(NotFound, match="no adapter 'a'"):
        engine.forward_backward(DATA_A[0], CE, "a")
    engine.create_adapter("a")                      # the name is free again
    assert engine.adapter_progress("a") == (0, 0)


def test_refusals_name_the_cause(tmp_path):
    engine = _engine(tmp_path)
    engine.create_adapter("a")
    with pytest.raises(FailedPrecondition, match="exists already"):
        engine.create_adapter("a")
    for bad in ("default", "", "has space", "x" * 65):
        with pytest.raises(ValueError, match="name:"):
            engine.create_adapter(bad)
    with pytest.raises(FailedPrecondition, match="no gradients"):
        engine.optim_step(ADAM, "a")
    with pytest.raises(NotFound, match="no adapter 'zz'"):
        engine.optim_step(ADAM, "zz")
    asked = _engine(tmp_path / "compiled", compile=True, warmup=False)   # compiled lazily: no graph built here
    with pytest.raises(FailedPrecondition, match="actor.compile: false"):
        asked.create_adapter("c")
    full = _engine(tmp_path / "full", lora=None)
    with pytest.raises(FailedPrecondition, match="need a LoRA trainer"):
        full.create_adapter("a")


def test_a_trainer_that_auto_compiled_goes_eager_at_its_first_named_adapter(tmp_path):
    engine = _engine(tmp_path)
    module = engine.rank.actor.module
    apply_compile(module, True, backend="eager")    # what actor.compile: auto does on CUDA (inductor there)
    engine.rank.compiled = True
    blocks = transformer_blocks(module)
    assert blocks and all(b._compiled_call_impl is not None for b in blocks)
    engine.create_adapter("a")
    assert all(b._compiled_call_impl is None for b in blocks)
    assert engine.rank.compiled is False
    assert engine.rank.resolved.value("actor.compile") is False
    assert "named adapters" in engine.rank.resolved.choices["actor.compile"].why
    before = _weights(engine, "a")
    engine.forward_backward(DATA_A[0], CE, "a")
    engine.optim_step(ADAM, "a")
    assert not _same(before, _weights(engine, "a"))
