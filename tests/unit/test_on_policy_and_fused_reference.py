"""The one-optimizer-step shortcut (no old log-prob pass) and the reference service's fused head path."""

from __future__ import annotations

import copy

import pytest
import torch

from coordinator.recipe.config import RunConfig
from coordinator.training.phases import needs_old_logprobs
from services.common.config import load_config
from services.common.tensors.weights import named_weights
from services.trainer.config import TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.testing import make_tiny_model, random_samples
from services.trainer.types import ActorLoss


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def engine(model_path: str) -> TrainerEngine:
    return TrainerEngine(load_config(TrainerSettings, data={"model": {"path": model_path},
                                                           "actor": {"lr": 1e-2, "shuffle": False}}))


def test_an_update_without_old_logprobs_equals_one_given_the_old_policys_logprobs(model_path):
    given, own = engine(model_path), engine(model_path)
    samples = random_samples(8, seed=5)
    with_old = copy.deepcopy(samples)
    for s, lp in zip(with_old, given.compute_logprobs([s.prompt_ids for s in samples],
                                                     [s.response_ids for s in samples])):
        s.old_logprobs = lp
    for s in samples:
        s.old_logprobs = []
    loss = ActorLoss(kl_coef=0.0)
    m_given, m_own = given.train_actor(with_old, loss), own.train_actor(samples, loss)
    assert m_own["pg_loss"] == pytest.approx(m_given["pg_loss"], abs=1e-6)
    assert m_own["approx_kl"] == 0.0 and m_own["clip_frac"] == 0.0
    pg, po = named_weights(given.rank.actor.module), named_weights(own.rank.actor.module)
    assert max(float((pg[k] - po[k]).abs().max()) for k in pg) < 1e-6
    # and the update moved the weights at all
    fresh = named_weights(engine(model_path).rank.actor.module)
    assert max(float((fresh[k] - po[k]).abs().max()) for k in po) > 1e-4


@pytest.mark.parametrize("loss", [ActorLoss(ppo_epochs=2), ActorLoss(mini_batch_size=4)])
def test_missing_old_logprobs_with_several_optimizer_steps_is_refused_naming_the_field(model_path, loss):
    e = engine(model_path)
    before = {k: v.clone() for k, v in named_weights(e.rank.actor.module).items()}
    samples = random_samples(8, seed=2)
    for s in samples:
        s.old_logprobs = []
    with pytest.raises(ValueError, match=r"old_logprobs: empty, which is allowed only for one optimizer step"):
        e.train_actor(samples, loss)
    after = named_weights(e.rank.actor.module)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_some_samples_without_old_logprobs_is_a_length_error_naming_the_sample(model_path):
    e = engine(model_path)
    samples = random_samples(4, seed=2)      # zeros as old log-probs
    samples[2].old_logprobs = []
    with pytest.raises(ValueError, match=r"samples\[2\]\.old_logprobs: 0 values"):
        e.train_actor(samples, ActorLoss())


class _Ctx:
    def __init__(self, step: int, **algorithm):
        self.step = step
        self.cfg = load_config(RunConfig, data={"algorithm": algorithm})


@pytest.mark.parametrize("algorithm,step,want", [
    ({}, 0, True),                                   # step 1: the parity check
    ({}, 1, False),
    ({}, 9, True),                                   # step 10
    ({"logprob_parity_every": 0}, 0, False),
    ({"old_logprobs": "always"}, 1, True),
    ({"ppo_epochs": 2}, 1, True),
    ({"ppo_mini_batch_size": 16}, 1, True),          # 32 samples: two optimizer steps
    ({"ppo_mini_batch_size": 32}, 1, False),
    ({"tis_cap": 2.0}, 1, True),
    ({"use_kl_in_reward": True}, 1, True),
])
def test_old_logprobs_are_skipped_only_when_one_optimizer_step_needs_none(algorithm, step, want):
    assert needs_old_logprobs(_Ctx(step, **algorithm), 32) is want


def test_the_fused_reference_path_equals_the_plain_one(model_path):
    from services.reference.config import ReferenceSettings
    from services.reference.engine import ReferenceEngine

    plain = ReferenceEngine(load_config(ReferenceSettings, data={"model": {"path": model_path}, "reference": {
        "fused_logprobs": False, "use_remove_padding": False}}))
    fused = ReferenceEngine(load_config(ReferenceSettings, data={"model": {"path": model_path}, "reference": {
        "use_remove_padding": True}}))   # fused by default; packing asked for
    assert not plain.info()["fused_logprobs"] and fused.info()["fused_logprobs"]
    assert not plain.info()["use_remove_padding"] and fused.info()["use_remove_padding"]
    samples = random_samples(9, seed=3)
    prompts, responses = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
    for temperature in (1.0, 0.7):
        a, b = plain.logprobs_sync(prompts, responses, temperature), fused.logprobs_sync(prompts, responses,
                                                                                         temperature)
        assert [len(x) for x in a] == [len(x) for x in b] == [len(r) for r in responses]
        assert max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)) < 1e-5


def test_the_compiled_reference_wraps_every_block_and_gives_the_same_logprobs(model_path, monkeypatch):
    from services.common.tensors import compile as block_compile
    from services.reference.config import ReferenceSettings
    from services.reference.engine import ReferenceEngine

    # Inductor's C++ codegen takes minutes on a 2-core CPU: dynamo's graphs on the eager backend instead.
    real = block_compile.apply_compile
    monkeypatch.setattr(block_compile, "apply_compile", lambda model, enabled: real(model, enabled, backend="eager"))
    plain = ReferenceEngine(load_config(ReferenceSettings, data={"model": {"path": model_path}}))
    compiled = ReferenceEngine(load_config(ReferenceSettings, data={"model": {"path": model_path},
                                                                    "reference": {"compile": True}}))
    assert not plain.info()["compile"] and compiled.info()["compile"]
    assert all(b._compiled_call_impl is not None for b in block_compile.transformer_blocks(compiled.model))
    samples = random_samples(6, seed=5)
    prompts, responses = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
    a, b = plain.logprobs_sync(prompts, responses), compiled.logprobs_sync(prompts, responses)
    assert max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)) < 1e-5
