"""Shared-prefix ("cascade") decode attention: the rows of a group that share their first blocks (a GRPO group's n
samples of one prompt, forked from one table) read that prefix's K/V once per group, not once per row.

attention.py's kernel reads every row's whole context: at 512 rows of 1,024-token prompts in groups of 8, each decode
step read each prompt's K/V 8 times (about 7 GB a step at the 0.5B shape, most of the step's memory traffic). Here a
group kernel, one program per (group, kv head, partition of the prefix), stacks the group's rows x G query heads
into one tile of queries (up to GROUP_QUERIES: 9 rows at G = 7) and runs the online softmax over the shared blocks
with one tl.dot per tile for all of them; each row's own program then covers only its suffix (its private blocks)
and merges the group's partials (max, sum, unnormalised output) into its output. Rows in no group (lo = 0) take the
plain path inside the same kernels.

The groups are found on the host once per window of steps (share_groups, from the host block tables): rows whose
leading blocks are the same pool blocks, up to the block before each row's current position (full blocks, never
written while the window runs: a row's writes go to its own blocks, copied on write before the window). They travel
as two small device tensors, lo [B] (shared tokens of each row, 0 outside a group) and groups [NG, RG] (the member
rows of each group, -1 past its end), which a captured CUDA graph reads by address like the block tables.
"""

from __future__ import annotations

import numpy as np
import torch

from services.rollout.engine_torch.paged import attention
from services.rollout.engine_torch.paged.attention import NUM_STAGES, NUM_WARPS, split_scratch, triton

GROUP_QUERIES = 64              # rows x G query heads stacked into one group program's dot
# The group program's tile (tokens), warps and pipeline stages; bench/cascade_attention.py sweeps them.
GROUP_TILE, GROUP_WARPS, GROUP_STAGES = 64, 4, 2
MIN_PREFIX_PARTITION = 256      # tokens of a prefix partition, at least (at the tables' full width)
MAX_PREFIX_PARTITIONS = 16
# A window whose longest shared prefix is shorter than this takes the plain path: the group kernel's grid is fixed at
# a graph's capture (max_groups x kv heads x prefix partitions of the tables' width), so it costs about the same
# whatever the prefix (24 us a layer at 256 rows, 1.5B shape, H200: bench/results/decode_profile_paged_1_5b_gpu.json,
# where 32-token prompts made the paged step 1.33x the unpaged decoder's), about what 256 rows reading a 256-token
# prefix each cost.
MIN_SHARED_TOKENS = 256
# The group kernel's grid is filled up to this many programs an SM (its programs are heavier than the row kernel's).
PREFIX_PROGRAMS_PER_SM = attention.PROGRAMS_PER_SM
if triton is not None:
    import triton.language as tl

    from services.rollout.engine_torch.paged.attention import attend_blocks


def rows_per_group(num_heads: int, num_kv: int) -> int:
    """Member rows of one group program (a larger group is cut into groups of this many); < 2: no cascade."""
    return GROUP_QUERIES // (num_heads // num_kv)


def max_groups(rows: int) -> int:
    return max(1, rows // 2)


def prefix_partitions(rows: int, kv_heads: int, width_tokens: int, sms: int) -> int:
    """Partitions of a group's prefix (host shapes only, fixed at a graph's capture): the grid filled up to
    PREFIX_PROGRAMS_PER_SM programs an SM for groups of 8 rows, each partition at least MIN_PREFIX_PARTITION
    tokens of the tables' width; a power of two."""
    want = PREFIX_PROGRAMS_PER_SM * sms // max(1, (rows // 8) * kv_heads)
    p = max(1, min(want, width_tokens // MIN_PREFIX_PARTITION, MAX_PREFIX_PARTITIONS))
    return 1 << (p.bit_length() - 1)


def worth_sharing(lo: torch.Tensor) -> bool:
    """Whether share_groups' lo [R] (each row's tokens read through its group) has a prefix long enough for the
    group path (MIN_SHARED_TOKENS)."""
    return lo.numel() > 0 and int(lo.max()) >= MIN_SHARED_TOKENS


def share_groups(tables: torch.Tensor, positions: torch.Tensor, block_size: int, per_group: int,
                 num_groups: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The groups of rows sharing leading blocks (host tensors): tables [R, w] (pool blocks), positions [R] (each
    row's next written position). Returns lo [R] (tokens each row reads through its group, 0 outside one) and
    groups [num_groups, per_group] (member rows, -1 past a group's end); None when no two rows share a block.
    Rows sorted by their tables (numpy's lexsort: ~1 ms at 512 x 80 entries, once a window) are next to the rows
    they share most with: a row's depth is its longest common run of leading blocks with a neighbour, and rows whose
    deepest shared block is the same and who sit together are a group (a larger one is cut at per_group). Its
    prefix is the blocks every member holds in the same places as its first row, full blocks only."""
    R, w = tables.shape
    if R < 2 or per_group < 2 or torch.unique(tables[:, 0]).numel() == R:
        return None
    cols = np.arange(w)
    full = (np.asarray(positions) // block_size)[:, None]               # blocks wholly before the next write
    t = np.where(cols[None, :] < full, tables.numpy(), -1 - np.arange(R)[:, None] * w - cols[None, :])
    order = np.lexsort(t.T[::-1])
    t = t[order]
    common = np.cumprod(t[1:] == t[:-1], axis=1).sum(1)                  # [R - 1] leading blocks equal to the next
    depth = np.zeros(R, dtype=np.int64)
    depth[:-1] = common
    depth[1:] = np.maximum(depth[1:], common)
    key = np.where(depth > 0, t[np.arange(R), np.maximum(depth - 1, 0)], -1 - np.arange(R))
    at = np.arange(R)
    run_start = np.ones(R, dtype=bool)
    run_start[1:] = key[1:] != key[:-1]
    first = np.maximum.accumulate(np.where(run_start, at, 0))
    piece = np.cumsum(run_start | ((at - first) % per_group == 0)) - 1
    starts = np.flatnonzero(np.r_[True, piece[1:] != piece[:-1]])
    same = np.cumprod(t == t[starts][piece], axis=1).sum(1)              # leading blocks equal to the first row's
    shared = np.minimum.reduceat(same, starts)
    grouped = (np.diff(np.r_[starts, R]) >= 2) & (shared > 0) & (key[starts] >= 0)
    rank = np.cumsum(grouped) - 1
    keep = (grouped & (rank < num_groups))[piece]                        # past num_groups: the plain path
    lo = np.zeros(R, dtype=np.int64)
    lo[order] = np.where(keep, shared[piece] * block_size, 0)
    groups = np.full((num_groups, per_group), -1, dtype=np.int64)
    groups[rank[piece][keep], (at - starts[piece])[keep]] = order[keep]
    return torch.from_numpy(lo), torch.from_numpy(groups)


if triton is not None:
    @triton.jit
    def _group_prefix_kernel(q_ptr, k_ptr, v_ptr, o_ptr, m_ptr, l_ptr, table_ptr, groups_ptr, lo_ptr, scale,
                             sq_b, sq_h, s_slot, s_kvh, st_b, H, PT, P0, PG,
                             G: tl.constexpr, RG: tl.constexpr, MP: tl.constexpr, HD: tl.constexpr,
                             BS: tl.constexpr, TILE: tl.constexpr, PREC: tl.constexpr):
        """Program (group, kv head, p): partition p of the group's shared prefix, for every member row's G query
        heads at once; partials to [B, H, PT](, HD) at P0 + p. An empty group (first member -1) has no prefix."""
        grp = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1).to(tl.int64)
        part = tl.program_id(2)
        i = tl.arange(0, MP)
        r = i // G
        d = tl.arange(0, HD)
        heads = kvh * G + i % G
        row = tl.load(groups_ptr + grp * RG + r, mask=r < RG, other=-1).to(tl.int64)
        live = row >= 0
        lead = tl.load(groups_ptr + grp * RG).to(tl.int64)
        S = tl.load(lo_ptr + tl.maximum(lead, 0))
        S = tl.where(lead >= 0, S, 0)                                  # every member's lo is the group's
        q = tl.load(q_ptr + row[:, None] * sq_b + heads[:, None] * sq_h + d[None, :], mask=live[:, None], other=0.0)
        chunk = tl.cdiv(tl.cdiv(S, PG), TILE) * TILE
        start = part * chunk
        end = tl.minimum(start + chunk, S)
        table = table_ptr + tl.maximum(lead, 0) * st_b                 # the leader's table: the members' prefix
        m, l, acc = attend_blocks(q, table, start, end, k_ptr, v_ptr, kvh, s_slot, s_kvh, scale, MP, HD, BS, TILE,
                                  PREC)
        slot = (row * H + heads) * PT + P0 + part
        tl.store(m_ptr + slot, m, mask=live)
        tl.store(l_ptr + slot, l, mask=live)
        tl.store(o_ptr + slot[:, None] * HD + d[None, :], acc, mask=live[:, None])


@torch.library.custom_op("meshrl::paged_decode_attention_shared", mutates_args=())
def paged_decode_attention_shared(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                                  ctx: torch.Tensor, lo: torch.Tensor, groups: torch.Tensor, block_size: int,
                                  scale: float, *, partitions: int | None = None, prefix_parts: int | None = None,
                                  group_tile: int | None = None, group_warps: int | None = None,
                                  group_stages: int | None = None) -> torch.Tensor:
    """attention.paged_decode_attention's result, the shared prefixes read once per group: lo [B] (int64, tokens of
    row b read through its group, 0 outside one; a multiple of block_size below ctx[b]), groups [NG, RG] (int64
    member rows, -1 past a group's end; every member's lo and leading lo / block_size table entries equal)."""
    B, H, hd = q.shape
    KV = k_pool.shape[1]
    G = H // KV
    NG, RG = groups.shape
    tile = attention.tile_tokens(block_size, hd)
    width = tables.size(1) * block_size
    sms = attention._sm_count(q.device)
    P = partitions or attention.num_partitions(B, KV, width, sms)
    PG = prefix_parts or prefix_partitions(B, KV, width, sms)
    PT, P0 = (P + PG, P) if P > 1 else (PG, 0)
    q, tables, ctx, lo, groups = (x.contiguous() for x in (q, tables, ctx, lo, groups))
    out = torch.empty_like(q)
    part_o, part_m, part_l = split_scratch(q, PT)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    common = dict(HD=hd, BS=block_size, TILE=tile, PREC=prec, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    strides = (q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), tables.stride(0))
    _group_prefix_kernel[(NG, KV, PG)](q, k_pool, v_pool, part_o, part_m, part_l, tables, groups, lo, scale,
                                       *strides, H, PT, P0, PG, G=G, RG=RG,
                                       MP=max(16, triton.next_power_of_2(RG * G)), HD=hd, BS=block_size,
                                       TILE=max(block_size, group_tile or GROUP_TILE), PREC=prec,
                                       num_warps=group_warps or GROUP_WARPS, num_stages=group_stages or GROUP_STAGES)
    rows = dict(G=G, GP=max(16, triton.next_power_of_2(G)), PREFIX=True, **common)
    if P == 1:
        attention._paged_decode_kernel[(B, KV, 1)](q, k_pool, v_pool, out, part_m, part_l, tables, ctx, lo, part_o,
                                                   scale, *strides, out.stride(0), out.stride(1), H, 1, PT,
                                                   SPLIT=False, PG=PG, **rows)
        return out
    attention._paged_decode_kernel[(B, KV, P)](q, k_pool, v_pool, part_o, part_m, part_l, tables, ctx, lo, part_o,
                                               scale, *strides, 0, 0, H, P, PT, SPLIT=True, PG=PG, **rows)
    attention._combine_kernel[(B, H)](part_o, part_m, part_l, out, lo, out.stride(0), out.stride(1), H, P, PT,
                                      PP=triton.next_power_of_2(PT), HD=hd, PREFIX=True, num_warps=NUM_WARPS)
    return out


@paged_decode_attention_shared.register_fake
def _(q, k_pool, v_pool, tables, ctx, lo, groups, block_size, scale, *, partitions=None, prefix_parts=None,
      group_tile=None, group_warps=None, group_stages=None):
    return q.new_empty(q.shape)
