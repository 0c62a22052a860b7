"""The model forward over block tables: each row feeds its new tokens (a prompt's uncached tail, a resumed row's
history, a tool response, or one decode token) at its own positions, writes their K/V into its blocks and attends to
every earlier token of its sequence through its block table.

The model's own modules do everything but attention (embedding, RMSNorms, projections, rotary embedding, MLP);
attention gathers each row's K/V slots by block table and runs scaled_dot_product_attention with a causal mask over
positions. Rows are right-padded to the longest new-token count; a padded query attends to the row's first key only,
and its output is never read. A forward whose rows all start their sequences (fresh prompts: nothing cached before
them) attends causally over its own K/V instead, as the model's own prefill does: on CUDA flash attention, with no
gather of the pool and no [rows, G x Q, C] mask.

A decode step (one token per row) with the Triton kernel, and the CUDA graphs' step (graphs.py), is DecodeStep:
the CUDA-graph decoder's layers (decode_layers.py: fused q/k/v and gate/up GEMMs, LoRA by group, the compiled layer
body), with this cache's KV write (index_copy_ into each row's pool slot) and attention over block tables.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from services.common.tensors.fused import host_to_device
from services.rollout.engine_torch.decode_layers import DecodeLayers
from services.rollout.engine_torch.paged import attention, cascade
from services.rollout.engine_torch.paged.kv import PagedKV


def slots_of(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Pool slot of each position: tables [B, nblk], positions [B, T] -> [B, T]."""
    blk = tables.gather(1, (positions // block_size).clamp(max=tables.size(1) - 1))
    return blk * block_size + positions % block_size


@torch.inference_mode()
def paged_forward(model, kv: PagedKV, tables: list[list[int]] | torch.Tensor, starts: list[int],
                  new: list[list[int]] | torch.Tensor, *, kernel: bool | None = None,
                  step: DecodeStep | None = None) -> torch.Tensor:
    """Feeds row b's tokens new[b] at positions starts[b]..; its blocks tables[b] (lists, or a host tensor
    [B, width] padded with any block) must cover them. new: lists, or a device tensor [B, Q] (every row Q tokens:
    a window's sampled tokens fed back without a host round trip). Returns the
    logits after each row's last new token, [B, V]: fp32, or the model's dtype from a decode step's DecodeStep. kernel: decode steps (one token per row) attend with the
    Triton kernel of attention.py, reading the pool in place (None: where it runs, on CUDA), through `step` (a
    DecodeStep over kv with the kernel; None: one built for this call)."""
    dev = kv.k[0].device
    if isinstance(new, torch.Tensor):
        ids, lens = new.to(dev), [new.size(1)] * new.size(0)
    else:
        # One host tensor each (a decode step at batch 512 builds these every token), then one copy to the device.
        lens = [len(t) for t in new]
        ids = host_to_device(torch.tensor([t + [0] * (max(lens) - len(t)) for t in new], dtype=torch.long), dev)
    B, Q = len(lens), max(lens)
    if not isinstance(tables, torch.Tensor):
        width = max(len(t) for t in tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    tab = tables.to(dev, non_blocking=True) if tables.device == dev else host_to_device(tables, dev)
    qlen = host_to_device(torch.tensor(lens, dtype=torch.long), dev)          # no host sync: a window may run
    start = host_to_device(torch.tensor(starts, dtype=torch.long), dev)
    pos = start[:, None] + torch.arange(Q, device=dev)                              # [B, Q]
    live = torch.arange(Q, device=dev)[None, :] < qlen[:, None]                      # [B, Q]
    pos = torch.where(live, pos, start[:, None])                                     # padded queries: no new slot
    hd = model.model.layers[0].self_attn.head_dim
    if kernel is None:
        kernel = attention.available(dev) and attention.supports(kv.block_size, hd)
    if Q == 1 and kernel:
        step = step if step is not None else DecodeStep(model, kv, kernel=True, compile=False)
        return step(ids, pos, tab, start + 1)
    # The live (row, query) positions as indices built on the host: a boolean mask index waits for the device
    # (twice a layer in the prefill of a GRPO step's 64 prompts: the GPU idled between the forward's kernels).
    flat = host_to_device((torch.arange(Q)[None, :] < torch.tensor(lens)[:, None]).flatten().nonzero()[:, 0], dev)
    write = slots_of(tab, pos, kv.block_size).flatten()[flat]                        # [N]
    read = mask = None
    if any(starts):                     # host ints: no sync. Some row attends to K/V of earlier calls too
        C = max(p + n for p, n in zip(starts, lens))
        keys = torch.arange(C, device=dev)
        read = slots_of(tab, keys.expand(B, C), kv.block_size)                       # [B, C]
        mask = (keys[None, None, :] <= pos[:, :, None])[:, None]                     # [B, 1, Q, C] causal
        # Grouped query attention without repeating K/V: each kv head's G query heads attend as G x Q queries.
        groups = model.config.num_attention_heads // model.config.num_key_value_heads
        mask = mask.repeat(1, 1, groups, 1)                                          # [B, 1, G * Q, C]
    m = model.model
    x = m.embed_tokens(ids)
    cos, sin = m.rotary_emb(x, pos)
    for i, layer in enumerate(m.layers):
        x = _layer(layer, x, cos, sin, kv.k[i], kv.v[i], write, read, flat, mask)
    x = m.norm(x)
    last = x[torch.arange(B, device=dev), qlen - 1]                                  # [B, d]
    return model.lm_head(last).float()


class DecodeStep(DecodeLayers):
    """One token per row from device tensors only (graph-safe: no host sync, static shapes) through the shared
    decode layers. Attention by the Triton kernel over the block tables, or (kernel=False: the CPU tests of the
    graph path) torch ops over every slot the tables can name, masked by the context lengths."""

    off_setting = "rollout.kv_cache: none"

    def __init__(self, model, kv: PagedKV, *, kernel: bool, compile: bool):
        super().__init__(model, compile=compile)
        self.kv, self.kernel = kv, kernel

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, tab: torch.Tensor, ctx: torch.Tensor,
                 share: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Logits [B, V] in the model's dtype (as the unpaged graph step keeps them: an fp32 copy of a [256, 151936]
        batch cost a pass of its own each step, and the samplers read either) after ids [B, 1] at pos [B, 1] of rows
        whose blocks are tab [B, width], ctx [B] tokens with K/V once this one is written. LoRA rows: the bank's
        current ones (a graph's: its static rows). share: (lo, groups) of cascade.share_groups on the device, the
        rows' shared prefixes read once per group (the kernel only)."""
        m, kv = self.model.model, self.kv
        slot = slots_of(tab, pos, kv.block_size)[:, 0]                                   # [B]
        read = mask = None
        if not self.kernel:
            keys = torch.arange(tab.size(1) * kv.block_size, device=tab.device)
            read = slots_of(tab, keys.expand(tab.size(0), -1), kv.block_size)            # [B, C]
            groups = self.num_heads // self.num_kv
            mask = (keys[None, :] < ctx[:, None])[:, None, None, :].expand(-1, 1, groups, -1)  # [B, 1, G, C]
        x = m.embed_tokens(ids)
        cos, sin = m.rotary_emb(x, pos)
        lora = self._step_mask(x)
        for i, layer in enumerate(m.layers):
            x = self._layer_fn(layer, x, cos, sin, self._proj[i], lora, kv.k[i], kv.v[i], slot, tab, ctx, read, mask,
                               share)
        return self.model.lm_head(m.norm(x)[:, 0])

    def _layer(self, layer, x, cos, sin, proj: tuple, lora: torch.Tensor | None, kc: torch.Tensor, vc: torch.Tensor,
               slot: torch.Tensor, tab: torch.Tensor, ctx: torch.Tensor, read: torch.Tensor | None,
               mask: torch.Tensor | None, share: tuple | None = None) -> torch.Tensor:
        """One decoder layer (decode_layers.py) against the layer's pool kc, vc."""
        return self._layer_body(layer, x, cos, sin, proj, lora, (kc, vc, slot, tab, ctx, read, mask, share))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                slot: torch.Tensor, tab: torch.Tensor, ctx: torch.Tensor, read: torch.Tensor | None,
                mask: torch.Tensor | None, share: tuple | None) -> torch.Tensor:
        """k, v into each row's pool slot of kc, vc [slots, KV, hd], then q against the row's first ctx tokens."""
        B = q.size(0)
        kc.index_copy_(0, slot, k[:, :, 0])
        vc.index_copy_(0, slot, v[:, :, 0])
        if read is None and share is not None:
            o = cascade.paged_decode_attention_shared(q[:, :, 0], kc, vc, tab, ctx, *share, self.kv.block_size,
                                                      self.scaling)
        elif read is None:
            o = attention.paged_decode_attention(q[:, :, 0], kc, vc, tab, ctx, self.kv.block_size, self.scaling)
        else:
            keys, values = kc[read].transpose(1, 2), vc[read].transpose(1, 2)           # [B, KV, C, hd]
            qg = q.reshape(B, self.num_kv, -1, self.head_dim)                           # [B, KV, G, hd]
            o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=self.scaling)
        return o.reshape(B, 1, -1)


def _layer(layer, x, cos, sin, kc: torch.Tensor, vc: torch.Tensor, write: torch.Tensor, read: torch.Tensor | None,
           flat: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """One decoder layer: writes the live tokens' K/V (flat: their indices among the B x Q queries) at their slots,
    attends over each row's gathered slots (read, mask), or (read None: every row's tokens start its sequence, a fresh
    prompt's prefill) causally over this forward's own K/V, as the model's own prefill does (flash attention on
    CUDA: no gather, no mask)."""
    a = layer.self_attn
    B, Q, _ = x.shape
    hd = a.head_dim
    h = layer.input_layernorm(x)
    q = a.q_proj(h).view(B, Q, -1, hd).transpose(1, 2)                               # [B, H, Q, hd]
    H = q.size(1)
    k = a.k_proj(h).view(B, Q, -1, hd).transpose(1, 2)                               # [B, KV, Q, hd]
    v = a.v_proj(h).view(B, Q, -1, hd).transpose(1, 2)
    q, k = sys.modules[type(a).__module__].apply_rotary_pos_emb(q, k, cos, sin)
    kc.index_copy_(0, write, k.transpose(1, 2).reshape(B * Q, -1, hd)[flat])       # [N, KV, hd]
    vc.index_copy_(0, write, v.transpose(1, 2).reshape(B * Q, -1, hd)[flat])
    if read is None:
        # Right-padded rows: a live query's causal keys are all live; a padded query's output is never read.
        G = H // k.size(1)
        o = F.scaled_dot_product_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), is_causal=True,
                                           scale=a.scaling)
    else:
        keys = kc[read].transpose(1, 2)                                               # [B, KV, C, hd]
        values = vc[read].transpose(1, 2)
        KV = keys.size(1)
        q = q.reshape(B, KV, (H // KV) * Q, hd)                                       # head h = kv * G + g
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=a.scaling).reshape(B, H, Q, hd)
    x = x + a.o_proj(o.transpose(1, 2).reshape(B, Q, -1))
    return x + layer.mlp(layer.post_attention_layernorm(x))
