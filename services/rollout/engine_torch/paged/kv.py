"""The paged KV cache's storage: per layer one K and one V tensor of num_blocks x block_size slots, sized from a
memory budget (rollout.kv_cache_gib, or auto)."""

from __future__ import annotations

import logging
import os

import torch

from services.rollout.config import AUTO_KV_PROMPT_TOKENS, auto_kv_pool_tokens

log = logging.getLogger("meshrl.rollout")

# auto budget on CUDA: room for max_batch_size rows (config.auto_kv_pool_tokens), at most this share of the memory
# free once the model is loaded (the rest: prefill activations, logits, the sampler's temporaries); on CPU, room for
# `CPU_AUTO_ROWS` full-length rows, at most CPU_AUTO_SHARE of the host's RAM (a 32k-context model would otherwise ask
# for hundreds of GiB).
CUDA_AUTO_SHARE = 0.5
CPU_AUTO_ROWS = 256
CPU_AUTO_SHARE = 0.1


class PagedKV:
    """K and V slots of every layer: k[layer] is [num_blocks * block_size, kv_heads, head_dim]."""

    def __init__(self, *, num_layers: int, num_kv: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device):
        self.block_size, self.num_blocks = block_size, num_blocks
        shape = (num_blocks * block_size, num_kv, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def copy_block(self, src: int, dst: int) -> None:
        """Copy on write: block dst gets block src's KV in every layer."""
        bs = self.block_size
        for t in (*self.k, *self.v):
            t[dst * bs:(dst + 1) * bs].copy_(t[src * bs:(src + 1) * bs])

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))


def block_bytes(model, block_size: int) -> int:
    """Bytes of one block over all layers (K and V) in the model's dtype."""
    cfg = model.config
    p = next(model.parameters())
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * block_size * p.element_size()


def num_blocks_for(model, *, block_size: int, budget_gib: float | None, max_model_len: int, max_batch_size: int = 1,
                   max_tokens: int = 1) -> tuple[int, str]:
    """(blocks, why) for a budget in GiB, or auto: on CUDA room for max_batch_size rows (config.auto_kv_pool_tokens)
    at most a share of free CUDA memory; on CPU CPU_AUTO_ROWS full rows."""
    per = block_bytes(model, block_size)
    device = next(model.parameters()).device
    if budget_gib is not None:
        n, why = int(budget_gib * 2**30) // per, f"rollout.kv_cache_gib={budget_gib}"
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        want = -(-auto_kv_pool_tokens(max_batch_size, max_tokens, max_model_len) // block_size)
        n = min(want, int(free * CUDA_AUTO_SHARE) // per)
        why = (f"auto: {max_batch_size} rows of {AUTO_KV_PROMPT_TOKENS} + 2 x {max_tokens} tokens" if n == want
               else f"auto: {CUDA_AUTO_SHARE:.0%} of free CUDA memory")
    else:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        n = min(CPU_AUTO_ROWS * -(-max_model_len // block_size), int(ram * CPU_AUTO_SHARE) // per)
        why = f"auto: {CPU_AUTO_ROWS} rows of max_model_len, at most {CPU_AUTO_SHARE:.0%} of RAM"
    if n < 1:
        raise ValueError(f"rollout.kv_cache_gib: {budget_gib} GiB holds no KV block ({per} bytes each); raise it")
    return n, why
