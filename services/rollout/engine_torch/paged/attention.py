"""Decode attention over block tables (a Triton kernel): one query token per row against the K/V of its blocks,
read in place from the pool, so a decode step copies no cache (the torch path gathers every row's slots first).

One program per (row, kv head) handles that head's G query heads together (grouped query attention: each block
of K/V is read once for all of them), walking the row's block table up to its context length with an online
softmax in fp32 (decode_attention.py's kernel, over a block table instead of a static cache). Used by the paged
decode step (forward.DecodeStep) on CUDA; tests/unit/test_paged_kv_attention.py runs it in Triton's CPU interpreter
against the torch path. Exposed as the custom op `meshrl::paged_decode_attention` so torch.compile (the step's
compiled layer) treats it as one opaque call.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path serves
    triton = None

NUM_WARPS = 4


def available(device) -> bool:
    return triton is not None and torch.device(device).type == "cuda"


def graphs_reason(device, block_size: int, head_dim: int) -> str | None:
    """Why the paged decode step cannot run its Triton kernel (and so its CUDA graphs) here, or None."""
    if not available(device):
        return f"device {device} has no CUDA with Triton"
    if not supports(block_size, head_dim):
        return f"kv_block_size {block_size} and head_dim {head_dim} must be powers of two >= 16"
    return None


def supports(block_size: int, head_dim: int) -> bool:
    """tl.dot needs power-of-two tiles of >= 16 on each side."""
    return all(x >= 16 and x & (x - 1) == 0 for x in (block_size, head_dim))


if triton is not None:
    @triton.jit
    def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, o_ptr, table_ptr, ctx_ptr, scale,
                             sq_b, sq_h, s_slot, s_kvh, st_b, so_b, so_h,
                             G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr,
                             PREC: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1).to(tl.int64)
        g = tl.arange(0, GP)
        d = tl.arange(0, HD)
        heads = kvh * G + g
        live = g < G
        q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=live[:, None], other=0.0)
        ctx = tl.load(ctx_ptr + b)                                   # tokens with K/V, the current one included
        m = tl.full([GP], -float("inf"), tl.float32)
        l = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, HD], tl.float32)
        for i in range(0, tl.cdiv(ctx, BS)):
            blk = tl.load(table_ptr + b * st_b + i).to(tl.int64)
            n = i * BS + tl.arange(0, BS)
            valid = n < ctx
            slot = blk * BS + tl.arange(0, BS)
            k = tl.load(k_ptr + slot[:, None] * s_slot + kvh * s_kvh + d[None, :], mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale                  # [GP, BS] fp32
            s = tl.where(valid[None, :], s, -float("inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + slot[:, None] * s_slot + kvh * s_kvh + d[None, :], mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m = m_new
        o = acc / l[:, None]
        tl.store(o_ptr + b * so_b + heads[:, None] * so_h + d[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=live[:, None])


@torch.library.custom_op("meshrl::paged_decode_attention", mutates_args=())
def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                           ctx: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v over the first ctx[b] positions of row b's blocks: q [B, H, hd] -> [B, H, hd].

    k_pool, v_pool [slots, KV, hd] (head_dim contiguous); tables int64 [B, nblk]; ctx int64 [B]."""
    B, H, hd = q.shape
    KV = k_pool.shape[1]
    G = H // KV
    q, tables, ctx = q.contiguous(), tables.contiguous(), ctx.contiguous()
    out = torch.empty_like(q)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    _paged_decode_kernel[(B, KV)](
        q, k_pool, v_pool, out, tables, ctx, scale,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), tables.stride(0), out.stride(0), out.stride(1),
        G=G, GP=max(16, triton.next_power_of_2(G)), HD=hd, BS=block_size, PREC=prec, num_warps=NUM_WARPS)
    return out


@paged_decode_attention.register_fake
def _(q, k_pool, v_pool, tables, ctx, block_size, scale):
    return q.new_empty(q.shape)             # contiguous, as the kernel's output
