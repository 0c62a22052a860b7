"""The rollout engine on the committed arith model and tokenizer (skipped until examples/arith/model exists)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from services.common.tensors.modeling import response_logprobs
from services.rollout.config import RolloutSettings
from services.rollout.engine_torch.engine import TorchEngine
from services.rollout.types import GenerateBatch, PromptInput, SamplingParams

ARITH_MODEL = Path(__file__).resolve().parents[2] / "examples" / "arith" / "model"
pytestmark = pytest.mark.skipif(not (ARITH_MODEL / "config.json").exists(),
                                reason="examples/arith/model not built yet (python examples/arith/sft.py)")
PROMPTS = ["37+45=", "9-3=", "12+88="]


@pytest.fixture(scope="module")
def engine(arith_model_path) -> TorchEngine:
    return TorchEngine(RolloutSettings(model={"path": arith_model_path}))


def test_text_prompts_get_the_same_ids_as_the_sft_tokenization(engine):
    results = engine.generate_sync(GenerateBatch([PromptInput(text=p) for p in PROMPTS],
                                                 SamplingParams(temperature=0, max_tokens=6)))
    for r, p in zip(results, PROMPTS):
        assert r.prompt_ids == engine.tokenizer(p)["input_ids"]


def test_greedy_answers_equal_the_sft_scripts_generate(engine):
    from examples.arith.sft import generate
    ours = [r.samples[0].text for r in engine.generate_sync(
        GenerateBatch([PromptInput(text=p) for p in PROMPTS], SamplingParams(temperature=0, max_tokens=6)))]
    theirs = [g[0] for g in generate(engine.model, engine.tokenizer, PROMPTS)]
    assert ours == theirs


def test_sampled_logprobs_on_the_arith_model_equal_the_trainers(engine):
    results = asyncio.run(engine.generate(GenerateBatch([PromptInput(text=p) for p in PROMPTS],
                                                        SamplingParams(n=4, temperature=1.0, max_tokens=6, seed=1))))
    prompts = [r.prompt_ids for r in results for _ in r.samples]
    samples = [s for r in results for s in r.samples]
    lp, _ = response_logprobs(engine.model, prompts, [s.response_ids for s in samples], pad_id=engine.pad_id)
    for i, s in enumerate(samples):
        assert torch.allclose(torch.tensor(s.logprobs), lp[i, :len(s.logprobs)], atol=1e-4, rtol=0)
