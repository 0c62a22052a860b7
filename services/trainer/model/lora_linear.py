"""One LoRA-adapted linear layer, y = x W^T + b + s (x A^T) B^T, as one opaque op with a hand-written backward that
never forms the frozen base's weight gradient and makes as few passes over [tokens, features] tensors as it can.

Why an op of its own: written with nn.Linear + addmm (the base output as C), the adapter path cost about what it
saved on a GPU. Its GEMMs have an inner size of the rank (16), so they run at memory speed and what they cost is the
passes over [tokens, features] tensors: ATen's out-of-place addmm copies C, then the GEMM reads and writes it (four
passes over [tokens, out]; inductor on CUDA turns it into mm + an add fused into the consumer where every consumer is
pointwise: o, gate, up, down; two passes), each twice with checkpointing; and backward added a separate [tokens, in]
gradient to the base's. About 205 GB of traffic per step at the 1.5B shape (28 blocks, 16k tokens), some 70 ms at
an H100's bandwidth: about what the frozen weight-gradient GEMMs it skips took (LoRA measured 0.994x a full step).

Here (on CUDA; see base_first) the adapter goes first and the base GEMM accumulates onto it (beta = 1, in place):
cuBLAS reads C in the epilogue of a GEMM that is compute-bound, so the adapter costs one pass over [tokens, in] (A)
and one over [tokens, out] (B) in forward; in backward dz and dB each read dy once, z and dA read x, and x's
gradient is dz A with the base's dy W accumulated onto it (one [tokens, in] write): about 160 GB at that shape (the
forward's passes are what it saves; the backward's stay as many).
Inductor cannot see inside (it would copy C again: its extern addmm is out of place), so the op is registered with
torch.library; compiled blocks call it as one node. Sums run in fp32 inside each GEMM and round once, as the base
GEMM alone would.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode


def base_first(x: torch.Tensor) -> bool:
    """Which GEMM accumulates onto the other's output. On CUDA the big one onto the adapter's (cuBLAS reads C in the
    epilogue of a compute-bound GEMM: hidden; the adapter's GEMM writes once). Elsewhere the adapter's onto the
    base's: oneDNN's bf16 GEMM on a CPU ran about 10% slower with beta = 1 (a LoRA step at 0.84x a full one
    instead of 0.78x, compiled), while the rank-16 read and write it then costs is cheap there."""
    return not x.is_cuda


def eager() -> bool:
    """Whether the adapted linears run as autograd.Functions (_EagerLinear, lora_group._EagerGroup): the same math
    without the torch.library op's dispatch, which costs about 170 us a forward and backward on the host (a tiny op:
    300 against 130 us on a CPU host), per layer; the eager trainer that several runs' adapters need waits on its
    host (docs/many_runs.md; on an H100 a 0.5B LoRA step took 0.45 s on the Functions, 0.64 s on the ops:
    bench/results/lora_merged_train_gpu.json). The op stays where torch.compile traces it (one node of the graph)
    and under a dispatch mode (selective checkpointing keeps each op's output, and the Functions' GEMMs accumulate in
    place)."""
    return not torch.compiler.is_compiling() and not is_in_torch_dispatch_mode()


@torch.library.custom_op("meshrl::lora_linear", mutates_args=())
def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                lora_b: torch.Tensor) -> torch.Tensor:
    """y [T, out] of x [T, in], weight [out, in], bias [out] or None, lora_a [r, in], lora_b [out, r] (scaled: the
    caller's s B, so that the scaling is no kernel of its own here), all in one dtype. Only y comes out (z = x A^T
    is recomputed in backward): a recomputed forward whose output backward does not need (the block's last layer,
    down_proj, under checkpointing) is then dead code that the compiler drops, as it drops a plain linear's; an op
    that also returned z would run its whole base GEMM again for it."""
    return project(x, weight, bias, torch.mm(x, lora_a.t()), lora_b)


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, z: torch.Tensor,
            scaled_b: torch.Tensor) -> torch.Tensor:
    """x W^T + b + z (sB)^T [T, out] for z = x A^T [T, r]: one GEMM accumulates onto the other's output in place."""
    if base_first(x):
        y = torch.mm(x, weight.t()) if bias is None else torch.addmm(bias, x, weight.t())
        return y.addmm_(z, scaled_b.t())
    y = torch.mm(z, scaled_b.t()) if bias is None else torch.addmm(bias, z, scaled_b.t())
    return y.addmm_(x, weight.t())                         # the base GEMM accumulates onto the adapter's part


@lora_linear.register_fake
def _(x, weight, bias, lora_a, lora_b):
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("meshrl::lora_linear_backward", mutates_args=())
def lora_linear_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                         lora_a: torch.Tensor, lora_b: torch.Tensor,
                         need_x: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx [T, in] or an empty tensor when x needs none, dA [r, in], dB [out, r] of the scaled B). No [out, in]
    product: the base weight is frozen."""
    return linear_backward(dy, x, weight, lora_a, lora_b, need_x)


def linear_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, lora_a: torch.Tensor,
                    lora_b: torch.Tensor, need_x: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """meshrl::lora_linear_backward's (dx, dA, dB) (_EagerLinear calls it without the op's dispatch)."""
    z = torch.mm(x, lora_a.t())                                                       # [T, r]
    dz = torch.mm(dy, lora_b)                                                         # [T, r]
    d_b = torch.mm(dy.t(), z)                                                         # [out, r]
    d_a = torch.mm(dz.t(), x)                                                        # [r, in]
    if not need_x:
        return x.new_empty(0), d_a, d_b
    dx = torch.mm(dy, weight).addmm_(dz, lora_a) if base_first(x) else torch.mm(dz, lora_a).addmm_(dy, weight)
    return dx, d_a, d_b


@lora_linear_backward.register_fake
def _(dy, x, weight, lora_a, lora_b, need_x):
    dx = x.new_empty(x.shape) if need_x else x.new_empty(0)
    return dx, lora_a.new_empty(lora_a.shape), lora_b.new_empty(lora_b.shape)


def _setup_context(ctx, inputs, output):
    x, weight, bias, lora_a, lora_b = inputs
    ctx.save_for_backward(x, weight, lora_a, lora_b)


def _backward(ctx, dy):
    x, weight, lora_a, lora_b = ctx.saved_tensors
    need_x = ctx.needs_input_grad[0]
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        raise RuntimeError("lora_linear: the base weight and bias are frozen; this op never computes their grads")
    dx, d_a, d_b = torch.ops.meshrl.lora_linear_backward(dy.contiguous(), x, weight, lora_a, lora_b, need_x)
    return (dx if need_x else None), None, None, d_a, d_b


lora_linear.register_autograd(_backward, setup_context=_setup_context)


class _EagerLinear(torch.autograd.Function):
    """meshrl::lora_linear as an autograd.Function (where `eager()`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b):
        ctx.save_for_backward(x, weight, lora_a, lora_b)
        return project(x, weight, bias, torch.mm(x, lora_a.t()), lora_b)

    @staticmethod
    def backward(ctx, dy):
        x, weight, lora_a, lora_b = ctx.saved_tensors
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            raise RuntimeError("lora_linear: the base weight and bias are frozen; this op never computes their grads")
        need_x = ctx.needs_input_grad[0]
        dx, d_a, d_b = linear_backward(dy.contiguous(), x, weight, lora_a, lora_b, need_x)
        return (dx if need_x else None), None, None, d_a, d_b


def adapted_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                   lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """base(x) + scaling * B(A(x)) for x [..., in] in the compute dtype: the autocast dtype under autocast (the fp32
    adapters are cast to it here, as autocast would: their gradients come back in fp32), else x's dtype. B is
    scaled in the same pass as its cast (one kernel under compile; the op's GEMMs need no scaling of their own)."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).to(dtype)
    op = _EagerLinear.apply if eager() else lora_linear
    y = op(x2, weight.to(dtype), None if bias is None else bias.to(dtype), lora_a.to(dtype),
           (lora_b * scaling).to(dtype))
    return y.view(*lead, y.shape[-1])
