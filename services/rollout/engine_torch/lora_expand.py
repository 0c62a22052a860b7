"""The graph decode step's LoRA expand as one Triton kernel (decode_layers.py): each row's shrink output h [N, K]
(x A^T of a group's k adapted members side by side, a slice of the base GEMM's output) kept in its slot's columns
by the step's mask [N, >= K] and multiplied by the group's block-diagonal B [OUT, K] -> the delta [N, OUT].

masked_expand (lora.py) does the same in two kernels, a mask multiply and a cuBLAS GEMM: at decode sizes each is a
few microseconds of launch-bound work, twice per projection group, four groups a layer. Here the mask is applied
to each tile as it is loaded and the product accumulates in fp32, as cuBLAS does, so the delta is masked_expand's
up to summation order. A custom op (`meshrl::lora_expand`), so the compiled layer calls it as it calls the paged
attention; on the CPU (and without Triton) it is masked_expand.
"""

from __future__ import annotations

import os

import torch

from services.rollout.engine_torch.lora import masked_expand

try:
    import triton
    import triton.language as tl
except ImportError:                       # pragma: no cover - Triton ships with CUDA torch
    triton = None

# Use the kernel where it can run (decode_layers reads this when it traces the step). Off until it is measured and
# tested on a GPU (bench/lora_gpu.py's decode part runs the LoRA engine with it on and off; tests/gpu/
# test_lora_decode_gpu.py with LORA_EXPAND=1 in the environment).
ENABLED = os.environ.get("LORA_EXPAND", "0") == "1"

if triton is not None:
    @triton.jit
    def _expand_kernel(h_ptr, h_stride, m_ptr, m_stride, b_ptr, b_stride, o_ptr, o_stride, N, OUT, K,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            hm = (rm[:, None] < N) & (rk[None, :] < K)
            h = tl.load(h_ptr + rm[:, None] * h_stride + rk[None, :], mask=hm, other=0.0)
            m = tl.load(m_ptr + rm[:, None] * m_stride + rk[None, :], mask=hm, other=0.0)
            b = tl.load(b_ptr + rn[None, :] * b_stride + rk[:, None], mask=(rn[None, :] < OUT) & (rk[:, None] < K),
                        other=0.0)                                                    # [BK, BN] of B^T
            kept = (h.to(tl.float32) * m.to(tl.float32)).to(b.dtype)              # exact: the mask is 0 or 1
            acc += tl.dot(kept, b)
        tl.store(o_ptr + rm[:, None] * o_stride + rn[None, :], acc.to(o_ptr.dtype.element_ty),
                 mask=(rm[:, None] < N) & (rn[None, :] < OUT))


def applies(h: torch.Tensor) -> bool:
    """Whether the kernel serves h (else masked_expand): CUDA, Triton at hand, switched on."""
    return ENABLED and triton is not None and h.is_cuda


def launch(h: torch.Tensor, mask: torch.Tensor, B: torch.Tensor, out: torch.Tensor, *, bm: int = 32, bn: int = 64,
           bk: int = 32) -> None:
    """The kernel over h [N, K] (rows may be strided), mask [N, >= K], B [OUT, K] into out [N, OUT] (contiguous).
    Runs on CUDA, or on CPU tensors under Triton's interpreter (the tests)."""
    N, K = h.shape
    OUT = B.shape[0]
    assert h.stride(1) == 1 and mask.stride(1) == 1 and B.stride(1) == 1 and out.is_contiguous()
    _expand_kernel[(triton.cdiv(N, bm), triton.cdiv(OUT, bn))](
        h, h.stride(0), mask, mask.stride(0), B, B.stride(0), out, out.stride(0), N, OUT, K, BM=bm, BN=bn, BK=bk,
        num_warps=4)


@torch.library.custom_op("meshrl::lora_expand", mutates_args=())
def lora_expand(h: torch.Tensor, mask: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """masked_expand(h, B, mask) for a decode step's h [N, K] (one token per row): the kernel on CUDA."""
    if not h.is_cuda or triton is None:
        return masked_expand(h, B, mask)
    out = h.new_empty((h.shape[0], B.shape[0]))
    launch(h, mask, B, out)
    return out


@lora_expand.register_fake
def _(h, mask, B):
    return h.new_empty((h.shape[0], B.shape[0]))
