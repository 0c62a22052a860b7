"""Settings of the reference service: the `reference:` section (the model defaults to `model:`)."""

from __future__ import annotations

from pydantic import Field

from services.common.config import MeshSettings, ModelConfig, PoolConfig, ServerConfig


class ReferenceConfig(PoolConfig):
    """`reference:` section. The model defaults to `model:` (the initial policy)."""

    model_path: str | None = None
    dtype: str | None = Field(None, pattern="^(float32|bfloat16|float16)$")
    device: str | None = None
    # Micro-batches are packed so that batch * longest sequence stays within this many tokens.
    micro_batch_token_budget: int = Field(16384, ge=1)
    max_batch_size: int = Field(4096, ge=1)
    # Log-probs through the trainer's fused LM head (services/common/fused.py): the head runs at response
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
