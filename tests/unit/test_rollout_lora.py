"""The torch engine serves LoRA adapters unmerged (services/rollout/engine_torch/lora.py): an adapter's log-probs
equal the merged model's, a batch mixing two adapters and base rows gives each row what it gets alone, and bad
adapters are refused with the old one kept."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.common.tensors.modeling import load_causal_lm
from services.rollout.config import RolloutSettings
from services.rollout.engine_torch.engine import TorchEngine, _Job
from services.rollout.testing import make_tiny_model
from services.rollout.types import GenerateBatch, PromptInput, SamplingParams
from services.trainer.model.lora import adapter_state, adapter_sync_config, merged_weights

PROMPTS = [[4, 5, 13, 6, 15], [7, 3, 9, 12, 8, 10, 11, 14, 16, 4, 4, 5], [20]]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class Lora:
    """rank/alpha/targets as a LoraSection has them (adapter_sync_config reads these)."""

    def __init__(self, rank: int, alpha: float, target_modules=TARGETS):
        self.rank, self.alpha, self.target_modules = rank, alpha, list(target_modules)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("rollout_lora"))


def trained_adapter(model_dir: str, seed: int, rank: int = 4, alpha: float = 8.0, targets=TARGETS):
    """A peft adapter with random (non-zero) A and B on the model, as a trainer would hold it after some steps:
    (its tensors under PEFT's saved names, its sync config, the merged weights)."""
    from peft import LoraConfig, inject_adapter_in_model

    model = load_causal_lm(model_dir, dtype="float32", device="cpu")
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets)), model,
                            adapter_name="default")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    lora = Lora(rank, alpha, targets)
    return ({k: v.clone() for k, v in adapter_state(model).items()}, adapter_sync_config(lora),
            {k: v.clone() for k, v in merged_weights(model).items()})


def make_engine(model_dir: str, **rollout) -> TorchEngine:
    return TorchEngine(RolloutSettings(model={"path": model_dir}, rollout={"enable_lora": True, "max_loras": 3,
                                                                           "max_lora_rank": 8, **rollout}))


def greedy(adapter: str = "", n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, temperature=0.0, max_tokens=8, adapter=adapter)


def batch(sampling: SamplingParams, prompts=PROMPTS) -> GenerateBatch:
    return GenerateBatch([PromptInput(id=f"p{i}", prompt_ids=list(p)) for i, p in enumerate(prompts)], sampling)


def samples(results):
    return [s for r in results for s in r.samples]


def assert_same(a, b):
    for x, y in zip(samples(a), samples(b), strict=True):
        assert x.response_ids == y.response_ids
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=2e-5, rtol=0)


def test_an_unmerged_adapter_gives_the_merged_models_tokens_and_logprobs(model_dir):
    tensors, config, merged = trained_adapter(model_dir, seed=1)
    lora = make_engine(model_dir)
    assert lora.supports_adapters
    lora.load_adapter("default", 3, config, tensors)
    plain = TorchEngine(RolloutSettings(model={"path": model_dir}, rollout={"enable_lora": False}))
    assert not plain.supports_adapters
    asyncio.run(plain.apply_update(3, merged))
    base = lora.generate_sync(batch(greedy()))
    with_adapter = lora.generate_sync(batch(greedy("default")))
    assert_same(with_adapter, plain.generate_sync(batch(greedy())))
    # The adapter changes the model (else the parity above proves nothing).
    assert any(x.logprobs != y.logprobs for x, y in zip(samples(base), samples(with_adapter)))
    assert lora.weight_version == 3 and lora.info()["adapters"] == '{"default": 3}'


def test_a_batch_of_two_adapters_and_base_rows_gives_each_row_what_it_gets_alone(model_dir):
    engine = make_engine(model_dir)
    for i, name in enumerate(("a", "b")):
        tensors, config, _ = trained_adapter(model_dir, seed=10 + i, rank=4 + 4 * i, alpha=8.0 * (i + 1))
        engine.load_adapter(name, 1, config, tensors)
    # The same prompts under every adapter: rows that share a prompt but not an adapter must not share a prefill.
    requests = [batch(greedy("a", n=2)), batch(greedy("")), batch(greedy("b"))]
    alone = [engine.generate_sync(b) for b in requests]
    mixed = engine._generate_jobs([_Job(b, engine.check_batch(b), None) for b in requests])
    for got, want in zip(mixed, alone, strict=True):
        assert_same(got, want)
    assert samples(alone[0])[0].logprobs != samples(alone[2])[0].logprobs


def test_a_bad_adapter_is_refused_and_the_loaded_one_stays(model_dir):
    engine = make_engine(model_dir)
    tensors, config, _ = trained_adapter(model_dir, seed=3)
    engine.load_adapter("default", 1, config, tensors)
    before = engine.generate_sync(batch(greedy("default")))
    cut = dict(tensors)
    cut.pop(next(k for k in cut if k.endswith("lora_B.weight")))
    with pytest.raises(ValueError, match="lora_A or lora_B alone"):
        engine.load_adapter("default", 2, config, cut)
    with pytest.raises(ValueError, match="max_lora_rank"):
        engine.load_adapter("default", 2, {**config, "r": 16}, tensors)
    with pytest.raises(ValueError, match="not loaded"):
        asyncio.run(engine.generate(batch(greedy("other"))))
    assert_same(engine.generate_sync(batch(greedy("default"))), before)
    assert engine.adapters.versions == {"default": 1}


def test_an_adapter_on_fewer_layers_leaves_the_others_at_the_base(model_dir):
    engine = make_engine(model_dir)
    tensors, config, merged = trained_adapter(model_dir, seed=5, targets=["q_proj", "v_proj"])
    engine.load_adapter("qv", 1, config, tensors)
    plain = TorchEngine(RolloutSettings(model={"path": model_dir}, rollout={"enable_lora": False}))
    asyncio.run(plain.apply_update(1, merged))
    assert_same(engine.generate_sync(batch(greedy("qv"))), plain.generate_sync(batch(greedy())))
