"""A LoRA group's expand and add in one kernel for the decode step (Triton kernels, the custom ops
`meshrl::lora_expand` and, for a gate/up group whose model's activation is SiLU, `meshrl::lora_swiglu`, which also
writes silu(gate) * up instead of the group's sum).

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
    def _member_delta(acc, y_ptr, b_ptr, rows, live, slot, cols, start, O, sy, sb, W: tl.constexpr,
                      R: tl.constexpr, KC: tl.constexpr, PREC: tl.constexpr):
        """acc [BM, BN] plus the rows' adapter delta on columns `cols` of a member whose first column in B (and in
        h, after the O base outputs) is `start` (-1: not adapted)."""
        if start >= 0:
            for c0 in range(R, W, KC):                                    # slot 0's columns (the base) skipped
                c = c0 + tl.arange(0, KC)
                if tl.sum(((slot >= c0 // R) & (slot <= (c0 + KC - 1) // R)).to(tl.int32)) > 0:
                    use = live[:, None] & (slot[:, None] == (c // R)[None, :]) & (c < W)[None, :]
                    h = tl.load(y_ptr + rows[:, None] * sy + (O + start + c)[None, :], mask=use, other=0.0)
                    bt = tl.load(b_ptr + cols[None, :] * sb + (start + c)[:, None], mask=(c < W)[:, None], other=0.0)
                    acc += tl.dot(h, bt, input_precision=PREC)
        return acc

    @triton.jit
    def _lora_expand_kernel(y_ptr, b_ptr, slot_ptr, out_ptr, N, O, b1, b2, s0, s1, s2, sy, sb, so,
                            W: tl.constexpr, R: tl.constexpr, KC: tl.constexpr, BM: tl.constexpr,
                            BN: tl.constexpr, PREC: tl.constexpr):
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        n0 = tl.program_id(1) * BN
        cols = n0 + tl.arange(0, BN)
        live = rows < N
        slot = tl.load(slot_ptr + rows, mask=live, other=0)
        base = tl.load(y_ptr + rows[:, None] * sy + cols[None, :], mask=live[:, None], other=0.0)
        # The member these columns belong to, and its first column in B.
        start = tl.where(n0 < b1, s0, tl.where(n0 < b2, s1, s2))
        acc = _member_delta(tl.zeros((BM, BN), dtype=tl.float32), y_ptr, b_ptr, rows, live, slot, cols, start, O,
                            sy, sb, W, R, KC, PREC)
        acc += base.to(tl.float32)
        tl.store(out_ptr + rows[:, None] * so + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=live[:, None])

    @triton.jit
    def _lora_swiglu_kernel(y_ptr, b_ptr, slot_ptr, out_ptr, N, I, s0, s1, sy, sb, so,
                            W: tl.constexpr, R: tl.constexpr, KC: tl.constexpr, BM: tl.constexpr,
                            BN: tl.constexpr, PREC: tl.constexpr):
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        live = rows < N
        slot = tl.load(slot_ptr + rows, mask=live, other=0)
        g = tl.load(y_ptr + rows[:, None] * sy + cols[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        u = tl.load(y_ptr + rows[:, None] * sy + (I + cols)[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        g = _member_delta(g, y_ptr, b_ptr, rows, live, slot, cols, s0, 2 * I, sy, sb, W, R, KC, PREC)
        u = _member_delta(u, y_ptr, b_ptr, rows, live, slot, I + cols, s1, 2 * I, sy, sb, W, R, KC, PREC)
        act = g / (1.0 + tl.exp(-g)) * u
        tl.store(out_ptr + rows[:, None] * so + cols[None, :], act.to(out_ptr.dtype.element_ty), mask=live[:, None])


def _blocks(N: int, width: int, rank: int) -> tuple[int, int]:
    """(rows a program, adapter columns a chunk): 4 adapters of rank 16 are one chunk (one dot, not four)."""
    return 16 if N <= 16 else 32 if N <= 64 else 64, max(16, min(128, triton.next_power_of_2(width - rank)))


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
    bm, kc = _blocks(N, width, rank)
    bounds = [sum(sizes[:i + 1]) for i in range(len(sizes))] + [O] * (3 - len(sizes))
    starts = list(starts) + [-1] * (3 - len(starts))
    _lora_expand_kernel[(triton.cdiv(N, bm), O // bn)](
        y, B, slots, out, N, O, bounds[0], bounds[1], *starts, y.stride(0), B.stride(0), out.stride(0),
        W=width, R=rank, KC=kc, BM=bm, BN=bn, PREC=_precision(y), num_warps=NUM_WARPS)
    return out


def _precision(y: torch.Tensor) -> str:
    return "ieee" if y.dtype == torch.float32 else "tf32"


@lora_expand.register_fake
def _(y, B, slots, sizes, starts, width, rank):
    return y.new_empty((y.shape[0], sum(sizes)))


@torch.library.custom_op("meshrl::lora_swiglu", mutates_args=())
def lora_swiglu(y: torch.Tensor, B: torch.Tensor, slots: torch.Tensor, sizes: list[int], starts: list[int],
                width: int, rank: int) -> torch.Tensor:
    """The MLP's activation silu(gate) * up with each row's adapter deltas, [N, I], from the gate/up group's GEMM
    y [N, 2I + k * width] (lora_expand's arguments, sizes [I, I]): the [N, 2I] sum never written."""
    N, I = y.shape[0], sizes[0]
    y, B = (t if t.stride(-1) == 1 else t.contiguous() for t in (y, B))
    out = torch.empty((N, I), dtype=y.dtype, device=y.device)
    bm, kc = _blocks(N, width, rank)
    bn = block_n(sizes)
    _lora_swiglu_kernel[(triton.cdiv(N, bm), I // bn)](
        y, B, slots, out, N, I, starts[0], starts[1], y.stride(0), B.stride(0), out.stride(0),
        W=width, R=rank, KC=kc, BM=bm, BN=bn, PREC=_precision(y), num_warps=NUM_WARPS)
    return out


@lora_swiglu.register_fake
def _(y, B, slots, sizes, starts, width, rank):
    return y.new_empty((y.shape[0], sizes[0]))
