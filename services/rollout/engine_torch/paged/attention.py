"""Decode attention over block tables (Triton kernels): one query token per row against the K/V of its blocks,
read in place from the pool, so a decode step copies no cache (the torch path gathers every row's slots first).

One program per (row, kv head[, partition]) handles that head's G query heads together (grouped query attention:
each K/V tile is read once for all of them), with an online softmax in fp32 (decode_attention.py's kernel, over a
block table instead of a static cache). Each iteration reads a tile of TILE tokens from TILE / block_size
consecutive table entries (slot = table[token // block_size] * block_size + token % block_size), one tl.dot each
for scores and values: 16-token blocks alone make tiny dots and a table load before every K/V load.

Split-K ("flash decoding"): where rows x kv heads would leave the GPU's SMs idle (few rows, long contexts), each
row's context is cut into P partitions, one program each (grid B x KV x P) writing its partial max, sum and
unnormalised output to scratch, and a small second kernel combines them. P depends on host-known shapes only
(rows, kv heads, table width: static per CUDA-graph capture, no sync on device data); each row splits its own
context length on the device, so a partition past a short row's context is empty and exits at once.

Used by the paged decode step (forward.DecodeStep) on CUDA; tests/unit/test_paged_kv_attention.py runs it in Triton's
CPU interpreter against torch. Exposed as the custom op `meshrl::paged_decode_attention` so torch.compile (the step's
compiled layer) treats it as one opaque call.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path serves
    triton = None

# sm_90 compile (offline): 3 stages prefetch the table entries and K/V tiles with cp.async, ~39 KB shared and
# ~100 registers a program at tile 128 x head_dim 64 or 64 x 128 (4-5 programs an SM).
NUM_WARPS = 4
NUM_STAGES = 3
TILE_ELEMENTS = 8192            # tokens x head_dim of one K (or V) tile: 128 tokens at head_dim 64, 64 at 128
MAX_TILE = 128
PROGRAMS_PER_SM = 4             # split-K fills the grid up to this many programs per SM ...
MIN_PARTITION_TOKENS = 128      # ... with each partition at least this long at the table's full width
MAX_PARTITIONS = 32


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


def tile_tokens(block_size: int, head_dim: int) -> int:
    """Tokens per iteration: TILE_ELEMENTS / head_dim (at most MAX_TILE), never less than one block."""
    return max(block_size, min(MAX_TILE, TILE_ELEMENTS // head_dim))


def num_partitions(rows: int, kv_heads: int, width_tokens: int, sms: int = 132) -> int:
    """Split-K partitions per row, from host-known shapes only: the grid filled up to PROGRAMS_PER_SM programs an
    SM (not past it: a second wave of half-length programs takes as long as one wave of whole ones), each partition
    at least MIN_PARTITION_TOKENS of the longest context the tables can hold; a power of two."""
    want = PROGRAMS_PER_SM * sms // max(1, rows * kv_heads)
    p = max(1, min(want, width_tokens // MIN_PARTITION_TOKENS, MAX_PARTITIONS))
    return 1 << (p.bit_length() - 1)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132                                  # the interpreter: an H100's count, so tests split as it would
    return torch.cuda.get_device_properties(device).multi_processor_count


if triton is not None:
    @triton.jit
    def attend_blocks(q, table, start, end, k_ptr, v_ptr, kvh, s_slot, s_kvh, scale, ROWS: tl.constexpr,
                      HD: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr, PREC: tl.constexpr):
        """The online softmax of the queries q [ROWS, HD] (one kv head's) over tokens [start, end) of the blocks
        `table` names, TILE tokens an iteration: -> (max [ROWS], sum [ROWS], unnormalised output [ROWS, HD]), fp32.
        The row kernel's loop over its own blocks and cascade.py's group kernel's over a group's shared ones."""
        d = tl.arange(0, HD)
        t = tl.arange(0, TILE)
        m = tl.full([ROWS], -float("inf"), tl.float32)
        l = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HD], tl.float32)
        for n0 in range(start, end, TILE):
            n = n0 + t
            valid = n < end
            blk = tl.load(table + n // BS, mask=valid, other=0).to(tl.int64)
            off = (blk * BS + n % BS)[:, None] * s_slot + kvh * s_kvh + d[None, :]
            k = tl.load(k_ptr + off, mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale                  # [ROWS, TILE] fp32
            s = tl.where(valid[None, :], s, -float("inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + off, mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m = m_new
        return m, l, acc

    @triton.jit
    def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, o_ptr, m_ptr, l_ptr, table_ptr, ctx_ptr, lo_ptr, pacc_ptr, scale,
                             sq_b, sq_h, s_slot, s_kvh, st_b, so_b, so_h, H, P, PT,
                             G: tl.constexpr, GP: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr,
                             TILE: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr,
                             PREFIX: tl.constexpr = False, PG: tl.constexpr = 1):
        """Program (b, kv head, p): partition p of row b's context. SPLIT: the partial (max, sum, unnormalised
        output) goes to m_ptr, l_ptr, o_ptr ([B, H, PT](, HD) fp32 scratch, partials 0..P-1); otherwise the output
        itself. PREFIX (cascade.py): the row's first lo[b] tokens are its group's shared prefix, attended by the
        group kernel; this program covers [lo[b], ctx) and, not SPLIT, merges the group kernel's PG partials
        (m_ptr, l_ptr, pacc_ptr at [B, H, PG](, HD)) of a row with lo[b] > 0 into its output."""
        b = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1).to(tl.int64)
        part = tl.program_id(2)
        g = tl.arange(0, GP)
        d = tl.arange(0, HD)
        heads = kvh * G + g
        live = g < G
        q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=live[:, None], other=0.0)
        ctx = tl.load(ctx_ptr + b)                                   # tokens with K/V, the current one included
        lo = ctx * 0
        if PREFIX:
            lo = tl.load(lo_ptr + b)
        chunk = tl.cdiv(tl.cdiv(ctx - lo, P), TILE) * TILE            # this row's partition length, whole tiles
        start = lo + part * chunk
        end = tl.minimum(start + chunk, ctx)
        m, l, acc = attend_blocks(q, table_ptr + b * st_b, start, end, k_ptr, v_ptr, kvh, s_slot, s_kvh, scale,
                                  GP, HD, BS, TILE, PREC)
        if SPLIT:
            row = (b * H + heads) * PT + part                         # [GP] into [B, H, PT]
            tl.store(m_ptr + row, m, mask=live)
            tl.store(l_ptr + row, l, mask=live)
            tl.store(o_ptr + row[:, None] * HD + d[None, :], acc, mask=live[:, None])
        else:
            if PREFIX:                      # the shared prefix's partials (none read for a row without one)
                acc, l = _merge_prefix(acc, m, l, m_ptr, l_ptr, pacc_ptr, (b * H + heads) * PG,
                                       live & (lo + g * 0 > 0), HD, PG)
            o = acc / l[:, None]
            tl.store(o_ptr + b * so_b + heads[:, None] * so_h + d[None, :], o.to(o_ptr.dtype.element_ty),
                     mask=live[:, None])

    @triton.jit
    def _merge_prefix(acc, m, l, m_ptr, l_ptr, acc_ptr, row, use, HD: tl.constexpr, PG: tl.constexpr):
        """(acc, l) with the PG partials at row * HD.. (max, sum, unnormalised output) of the heads in `use` merged
        in: the shared prefix's, from cascade.py's group kernel. m is finite (the suffix holds the current token)."""
        d = tl.arange(0, HD)
        for j in tl.static_range(PG):
            mj = tl.load(m_ptr + row + j, mask=use, other=-float("inf"))
            lj = tl.load(l_ptr + row + j, mask=use, other=0.0)
            aj = tl.load(acc_ptr + (row + j)[:, None] * HD + d[None, :], mask=use[:, None], other=0.0)
            m_new = tl.maximum(m, mj)
            alpha, beta = tl.exp(m - m_new), tl.exp(mj - m_new)
            acc = acc * alpha[:, None] + aj * beta[:, None]
            l = l * alpha + lj * beta
            m = m_new
        return acc, l

    @triton.jit
    def _combine_kernel(acc_ptr, m_ptr, l_ptr, o_ptr, lo_ptr, so_b, so_h, H, P, PT,
                        PP: tl.constexpr, HD: tl.constexpr, PREFIX: tl.constexpr = False):
        """Program (b, head): its P partials (an empty one has max -inf, sum 0) -> the softmax-weighted output.
        PREFIX: partials P..PT-1 are the group kernel's over the row's shared prefix, read where lo[b] > 0."""
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        p = tl.arange(0, PP)
        d = tl.arange(0, HD)
        live = p < P
        if PREFIX:
            live = live | ((p < PT) & (tl.load(lo_ptr + b) + p * 0 > 0))
        row = (b * H + h) * PT + p
        m = tl.load(m_ptr + row, mask=live, other=-float("inf"))
        l = tl.load(l_ptr + row, mask=live, other=0.0)
        w = tl.where(m > -float("inf"), tl.exp(m - tl.max(m, 0)), 0.0)                # [PP]
        acc = tl.load(acc_ptr + row[:, None] * HD + d[None, :], mask=live[:, None], other=0.0)
        o = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
        tl.store(o_ptr + b * so_b + h * so_h + d, o.to(o_ptr.dtype.element_ty))


@torch.library.custom_op("meshrl::paged_decode_attention", mutates_args=())
def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                           ctx: torch.Tensor, block_size: int, scale: float, *, tile: int | None = None,
                           partitions: int | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v over the first ctx[b] positions of row b's blocks: q [B, H, hd] -> [B, H, hd].

    k_pool, v_pool [slots, KV, hd] (head_dim contiguous); tables int64 [B, nblk]; ctx int64 [B], each in
    1..nblk * block_size (table entries past a row's context are never read). tile (tokens per iteration, a power
    of two >= block_size) and partitions (split-K, >= 1) default to tile_tokens and num_partitions: host shapes
    only, so a CUDA graph's capture fixes them; the split-K scratch is allocated here (the graph's pool)."""
    B, H, hd = q.shape
    KV = k_pool.shape[1]
    G = H // KV
    tile = tile or tile_tokens(block_size, hd)
    assert tile >= block_size and tile & (tile - 1) == 0, (tile, block_size)
    P = partitions or num_partitions(B, KV, tables.size(1) * block_size, _sm_count(q.device))
    q, tables, ctx = q.contiguous(), tables.contiguous(), ctx.contiguous()
    out = torch.empty_like(q)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    shapes = dict(G=G, GP=max(16, triton.next_power_of_2(G)), HD=hd, BS=block_size, TILE=tile, PREC=prec,
                  num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    strides = (q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), tables.stride(0))
    if P == 1:
        _paged_decode_kernel[(B, KV, 1)](q, k_pool, v_pool, out, out, out, tables, ctx, ctx, out, scale, *strides,
                                         out.stride(0), out.stride(1), H, 1, 1, SPLIT=False, **shapes)
        return out
    part_o, part_m, part_l = split_scratch(q, P)
    _paged_decode_kernel[(B, KV, P)](q, k_pool, v_pool, part_o, part_m, part_l, tables, ctx, ctx, out, scale,
                                     *strides, 0, 0, H, P, P, SPLIT=True, **shapes)
    _combine_kernel[(B, H)](part_o, part_m, part_l, out, ctx, out.stride(0), out.stride(1), H, P, P,
                            PP=triton.next_power_of_2(P), HD=hd, num_warps=NUM_WARPS)
    return out


def split_scratch(q: torch.Tensor, partials: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scratch for `partials` partial results per (row, head): unnormalised outputs [B, H, n, hd], maxes and sums
    [B, H, n], fp32."""
    B, H, hd = q.shape
    m = torch.empty((B, H, partials), dtype=torch.float32, device=q.device)
    return torch.empty((B, H, partials, hd), dtype=torch.float32, device=q.device), m, torch.empty_like(m)


@paged_decode_attention.register_fake
def _(q, k_pool, v_pool, tables, ctx, block_size, scale, *, tile=None, partitions=None):
    return q.new_empty(q.shape)             # contiguous, as the kernel's output
