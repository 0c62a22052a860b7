"""A LoRA group's expand and add in one kernel for the decode step (a Triton kernel, the custom op
`meshrl::lora_expand`).

The decode step's grouped GEMM (decode_layers.py) gives, per row, the members' base outputs followed by the shrink
h = x A^T over every adapter slot's columns. The torch path then runs three kernels per group: h times the rows' slot
mask, the block-diagonal expand GEMM over all k * W columns (zeros off the blocks included), and the add onto the
base outputs. At decode sizes each is a few microseconds of launch and tail, four groups a layer: the gap between an
engine serving adapters and one that serves none (bench/lora_gpu.py's decode part).

Here one program per (block of rows, block of output columns) reads its member's columns of B only (a block lies in
one member: BN divides every member's width), the h columns of the slots its rows use (a chunk no row of the block
uses is skipped, slot 0 the base model's always), accumulates in fp32 and adds the base output once before the one
rounding to the model's dtype. Exact for rows of slot 0 (the base output unchanged).
"""

from __future__ import annotations

from typing import Sequence

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the decode step keeps the torch ops
    triton = None

NUM_WARPS = 4


def block_n(sizes: Sequence[int]) -> int | None:
    """The widest column block (64, 32 or 16) that divides every member's width; None when none does (the torch
    path serves that group)."""
    return next((bn for bn in (64, 32, 16) if all(s % bn == 0 for s in sizes)), None)


def available(device: torch.device, sizes: Sequence[int]) -> bool:
    """Whether the kernel serves a group of members `sizes` wide on `device`."""
    return triton is not None and torch.device(device).type == "cuda" and block_n(sizes) is not None


if triton is not None:
    @triton.jit
    def _lora_expand_kernel(y_ptr, b_ptr, slot_ptr, out_ptr, N, O, b1, b2, s0, s1, s2, sy, sb, so,
                            W: tl.constexpr, R: tl.constexpr, KC: tl.constexpr, BM: tl.constexpr,
                            BN: tl.constexpr, PREC: tl.constexpr):
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        n0 = tl.program_id(1) * BN
        cols = n0 + tl.arange(0, BN)
        live = rows < N
        slot = tl.load(slot_ptr + rows, mask=live, other=0)
        # The member these columns belong to, and its first column in B (and in h after the base outputs).
        start = tl.where(n0 < b1, s0, tl.where(n0 < b2, s1, s2))
        base = tl.load(y_ptr + rows[:, None] * sy + cols[None, :], mask=live[:, None], other=0.0)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if start >= 0:                                                    # an adapted member
            for c0 in range(R, W, KC):                                    # slot 0's columns (the base) skipped
                c = c0 + tl.arange(0, KC)
                if tl.sum(((slot >= c0 // R) & (slot <= (c0 + KC - 1) // R)).to(tl.int32)) > 0:
                    use = live[:, None] & (slot[:, None] == (c // R)[None, :]) & (c < W)[None, :]
                    h = tl.load(y_ptr + rows[:, None] * sy + (O + start + c)[None, :], mask=use, other=0.0)
                    bt = tl.load(b_ptr + cols[None, :] * sb + (start + c)[:, None], mask=(c < W)[:, None], other=0.0)
                    acc += tl.dot(h, bt, input_precision=PREC)
        acc += base.to(tl.float32)
        tl.store(out_ptr + rows[:, None] * so + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=live[:, None])


@torch.library.custom_op("meshrl::lora_expand", mutates_args=())
def lora_expand(y: torch.Tensor, B: torch.Tensor, slots: torch.Tensor, sizes: list[int], starts: list[int],
                width: int, rank: int) -> torch.Tensor:
    """A group's base outputs plus each row's adapter delta, [N, O]: y [N, O + k * width] (the members' base outputs,
    O = sum(sizes), then h = x A^T over the k adapted members' slot columns), B [O, k * width] block-diagonal
    (member i's rows read columns starts[i] .. + width; -1: not adapted), slots int64 [>= N] (each row's adapter slot,
    0 = none; slot s in columns s * rank ..), at most 3 members."""
    N, O = y.shape[0], sum(sizes)
    bn = block_n(sizes)
    y, B = (t if t.stride(-1) == 1 else t.contiguous() for t in (y, B))
    out = torch.empty((N, O), dtype=y.dtype, device=y.device)
    bm = 16 if N <= 16 else 32 if N <= 64 else 64
    kc = max(16, min(128, triton.next_power_of_2(width - rank)))     # 4 adapters of rank 16: one chunk
    bounds = [sum(sizes[:i + 1]) for i in range(len(sizes))] + [O] * (3 - len(sizes))
    starts = list(starts) + [-1] * (3 - len(starts))
    prec = "ieee" if y.dtype == torch.float32 else "tf32"
    _lora_expand_kernel[(triton.cdiv(N, bm), O // bn)](
        y, B, slots, out, N, O, bounds[0], bounds[1], *starts, y.stride(0), B.stride(0), out.stride(0),
        W=width, R=rank, KC=kc, BM=bm, BN=bn, PREC=prec, num_warps=NUM_WARPS)
    return out


@lora_expand.register_fake
def _(y, B, slots, sizes, starts, width, rank):
    return y.new_empty((y.shape[0], sum(sizes)))
