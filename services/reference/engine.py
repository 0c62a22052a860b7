"""Reference engine: a frozen copy of the initial policy that scores token sequences."""

from __future__ import annotations

import asyncio
import logging

import torch
from pydantic import Field

from services.common.config import MeshSettings, ModelConfig, PoolConfig, ServerConfig
from services.common.modeling import batched_logprobs, load_causal_lm, set_threads, validate_sequences

log = logging.getLogger("meshrl.reference")


class ReferenceConfig(PoolConfig):
    """`reference:` section. The model defaults to `model:` (the initial policy)."""

    model_path: str | None = None
    dtype: str | None = Field(None, pattern="^(float32|bfloat16|float16)$")
    device: str | None = None
    # Micro-batches are packed so that batch * longest sequence stays within this many tokens.
    micro_batch_token_budget: int = Field(16384, ge=1)
    max_batch_size: int = Field(4096, ge=1)
    # Log-probs through the trainer's fused LM head (services/trainer/fused.py): the head runs at response
    # positions only and a Triton row kernel takes the log-softmax, so no fp32 [tokens, vocab] logits exist.
    # None = on for CUDA, off elsewhere (the plain path is then bit-identical to the trainer's ComputeLogProbs).
    fused_logprobs: bool | None = None
    # torch.compile each decoder block (the trainer's regional compilation: one graph serves every block;
    # compiles at the first calls). None = on for CUDA, off elsewhere.
    compile: bool | None = None


class ReferenceSettings(MeshSettings):
    model: ModelConfig = ModelConfig()
    reference: ReferenceConfig = ReferenceConfig()
    server: ServerConfig = ServerConfig()


class ReferenceEngine:
    """Serves log-probs of a frozen model; no gRPC here."""

    def __init__(self, settings: ReferenceSettings):
        ref, m = settings.reference, settings.model
        self.model_path = ref.model_path or m.path
        self.dtype = ref.dtype or m.dtype
        self.device = ref.device or m.device
        self.config = ref
        set_threads(m.num_threads)
        self.model = load_causal_lm(self.model_path, dtype=self.dtype, device=self.device)
        self.fused = ref.fused_logprobs if ref.fused_logprobs is not None else str(self.device).startswith("cuda")
        if self.fused:
            from services.trainer.fused import enable_fused_head

            enable_fused_head(self.model)
        self.compiled = ref.compile if ref.compile is not None else str(self.device).startswith("cuda")
        if self.compiled:
            from services.trainer.parallelize import apply_compile

            apply_compile(self.model, True)
        self.pad_id = self.model.config.pad_token_id or 0
        self.vocab_size = self.model.config.vocab_size
        self.max_len = getattr(self.model.config, "max_position_embeddings", None)
        # One forward at a time: torch CPU work is not faster when interleaved, and memory stays bounded.
        self._lock = asyncio.Lock()
        self.num_calls = 0
        log.info("reference model %s loaded on %s (%s)", self.model_path, self.device, self.dtype)

    def info(self) -> dict:
        return {"dtype": self.dtype, "device": self.device, "num_calls": self.num_calls, "micro_batch_token_budget":
                self.config.micro_batch_token_budget, "max_model_len": self.max_len, "fused_logprobs": self.fused,
                "compile": self.compiled}

    def logprobs_sync(self, prompts, responses, temperature: float = 1.0, *, as_arrays: bool = False):
        """Rows as lists, or float32 numpy arrays with as_arrays."""
        validate_sequences(prompts, responses, vocab_size=self.vocab_size, max_len=self.max_len)
        if len(prompts) > self.config.max_batch_size:
            raise ValueError(f"sequences: {len(prompts)} exceed reference.max_batch_size={self.config.max_batch_size}")
        return batched_logprobs(self.model, prompts, responses, pad_id=self.pad_id, temperature=temperature,
                                token_budget=self.config.micro_batch_token_budget, fused=self.fused,
                                as_arrays=as_arrays)

    async def logprobs(self, prompts, responses, temperature: float = 1.0, *, as_arrays: bool = False):
        self.num_calls += 1
        async with self._lock:
            return await asyncio.to_thread(self.logprobs_sync, prompts, responses, temperature, as_arrays=as_arrays)
