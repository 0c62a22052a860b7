"""Settings of the reference service: the `reference:` section (the model defaults to `model:`)."""

from __future__ import annotations

from pydantic import Field

from services.common.auto import AUTO, Auto
from services.common.config import MeshSettings, ModelConfig, PoolConfig, ServerConfig


class ReferenceConfig(PoolConfig):
    """`reference:` section. The model defaults to `model:` (the initial policy)."""

    model_path: str | None = None
    dtype: str | None = Field(None, pattern="^(float32|bfloat16|float16)$")
    device: str | None = None
    # Tokens per micro-batch: the packed row's length (use_remove_padding), else batch * longest sequence.
    micro_batch_token_budget: int = Field(16384, ge=1)
    max_batch_size: int = Field(4096, ge=1)
    # Log-probs through the trainer's fused LM head (services/common/tensors/fused.py): the head runs at response
    # positions only, in row chunks (a Triton row kernel on CUDA), so no fp32 [tokens, vocab] logits exist.
    # auto (or null): on wherever the head can be fused (the trainer's default too: both compute alike).
    fused_logprobs: bool | Auto | None = AUTO
    # Packed rows without padding, as the trainer's actor.use_remove_padding. auto (or null): on for a
    # half-precision model on CUDA that can pack, off otherwise.
    use_remove_padding: bool | Auto | None = AUTO
    # torch.compile each decoder block (the trainer's regional compilation: one graph serves every block;
    # compiled during the replica's warm-up, before it serves). auto (or null): on for CUDA, off elsewhere.
    compile: bool | Auto | None = AUTO
    # With compile: two no-grad forwards at two lengths before serving, so the first call compiles nothing.
    warmup: bool = True


class ReferenceSettings(MeshSettings):
    model: ModelConfig = ModelConfig()
    reference: ReferenceConfig = ReferenceConfig()
    server: ServerConfig = ServerConfig()
