"""Length-aware attention of one query token per row against a static KV cache (a Triton kernel).

The CUDA-graph decoder keeps a [B, kv_heads, S, head_dim] cache per layer, S a length bucket. Its torch
attention multiplies every query with all S slots and masks the ones outside [pad, current]; at the
start of a 256-token rollout most of them are empty. This kernel reads, per (row, kv head), only the
blocks of slots from the row's first valid slot up to the current one, whose index it loads from a
device tensor -- so a captured graph, replayed once per token, does the work of that token's length.

One program per (row, kv head) handles the head's G = heads / kv_heads query heads together (grouped
query attention: the kv blocks are read once for all of them), with an online softmax in fp32; scores
are never rounded to the cache dtype (the torch path rounds them to bf16 before its fp32 softmax).
Exposed as the custom op `meshrl::decode_attention` so torch.compile treats it as one opaque call.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the decoder keeps its torch attention
    triton = None

BLOCK_N = 32          # cache slots per loop iteration (bench/decode_step.py: 32 beat 64 and 128 on the H200)
NUM_WARPS = 4


def available(device: torch.device) -> bool:
    return triton is not None and torch.device(device).type == "cuda"


if triton is not None:
    @triton.jit
    def _decode_attn_kernel(q_ptr, k_ptr, v_ptr, o_ptr, pad_ptr, slot_ptr, scale,
                            sq_b, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, so_b, so_h,
                            G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, BN: tl.constexpr,
                            PREC: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1).to(tl.int64)
        g = tl.arange(0, GP)
        d = tl.arange(0, HD)
        heads = kvh * G + g
        live = g < G
        q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=live[:, None], other=0.0)
        pad = tl.load(pad_ptr + b)
        last = tl.load(slot_ptr)                                  # the current slot, inclusive
        k_base = k_ptr + b * sk_b + kvh * sk_h
        v_base = v_ptr + b * sv_b + kvh * sv_h
        m = tl.full([GP], -float("inf"), tl.float32)
        l = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, HD], tl.float32)
        for n0 in range((pad // BN) * BN, last + 1, BN):
            n = n0 + tl.arange(0, BN)
            valid = (n >= pad) & (n <= last)
            k = tl.load(k_base + n[:, None] * sk_s + d[None, :], mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale                      # [GP, BN] fp32
            s = tl.where(valid[None, :], s, -float("inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(v_base + n[:, None] * sv_s + d[None, :], mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m = m_new
        o = acc / l[:, None]
        tl.store(o_ptr + b * so_b + heads[:, None] * so_h + d[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=live[:, None])


@torch.library.custom_op("meshrl::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pad: torch.Tensor,
                     slot: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v over slots [pad[b], slot] of each row b: q [B, H, hd] -> [B, H, hd].

    k_cache, v_cache [B, KV, S, hd] (head_dim contiguous); pad int64 [B]; slot int64 [1] (inclusive)."""
    B, H, hd = q.shape
    KV = k_cache.shape[1]
    G = H // KV
    q = q.contiguous()
    out = torch.empty_like(q)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    _decode_attn_kernel[(B, KV)](
        q, k_cache, v_cache, out, pad, slot, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        G=G, GP=max(16, triton.next_power_of_2(G)), HD=hd, BN=BLOCK_N, PREC=prec, num_warps=NUM_WARPS)
    return out


@decode_attention.register_fake
def _(q, k_cache, v_cache, pad, slot, scale):
    return torch.empty_like(q)
