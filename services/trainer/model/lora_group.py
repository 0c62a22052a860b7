"""LoRA-adapted linears that read one input (q/k/v of attention, gate/up of the MLP) as one opaque op: x is read
once for all their adapters, forward and backward.

Per member the op does what meshrl::lora_linear does (services/trainer/model/lora_linear.py: on CUDA the adapter's
part first and the base GEMM accumulating onto it, no frozen weight gradient). What the group adds: z = x A^T is one
GEMM over the members' A stacked ([R, in], R the sum of their ranks), where each adapted linear read x for its own;
backward makes one dz [T, R], one dA = dz^T x of the stacked A, and one x gradient (dz A, every member's dy W
accumulated onto it in place), where each member wrote its own [T, in] gradient and autograd summed them.

z comes out of the op too (not differentiable; callers drop it), so backward reuses it instead of reading x again:
the group's outputs are what attention and the MLP's activation need in backward, so a recomputing checkpoint runs
the op again anyway and z comes with it for free; selective checkpointing keeps it beside them ([T, R]: small). A lone
linear whose output backward does not need (o_proj, down_proj) keeps lora_linear, which returns y alone so that its
recompute stays dead code.

Reads of x [T, in] by a group of k members in one training step under full checkpointing: before, 2k in forward, 2k
in the recompute, 2k in backward (z again, dA), plus k [T, in] gradients written and summed; now k + 1, k + 1, and 1
(dA), one [T, in] gradient written. The base GEMMs (k reads of x, k of dy) are as before.
"""

from __future__ import annotations

import torch

from services.trainer.model import lora_linear


@torch.library.custom_op("meshrl::lora_group", mutates_args=())
def lora_group(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor], lora_a: torch.Tensor,
               lora_b: list[torch.Tensor], scalings: list[float]) -> list[torch.Tensor]:
    """[y_1, ..., y_k, z]: y_i [T, out_i] = x W_i^T + b_i + s_i z_i B_i^T for x [T, in], weights[i] [out_i, in],
    biases[i] [out_i] (biases empty: no member has one), lora_a [R, in] (the members' A stacked in order),
    lora_b[i] [out_i, r_i]; z = x A^T [T, R] (z_i its columns of member i), all in one dtype."""
    z = torch.mm(x, lora_a.t())                                                       # [T, R]
    ys, start = [], 0
    for weight, bias, b, scaling in zip(weights, biases or [None] * len(weights), lora_b, scalings):
        ys.append(lora_linear.project(x, weight, bias, z[:, start:start + b.shape[1]], b * scaling))
        start += b.shape[1]
    return ys + [z]


@lora_group.register_fake
def _(x, weights, biases, lora_a, lora_b, scalings):
    return [x.new_empty(x.shape[0], w.shape[0]) for w in weights] + [x.new_empty(x.shape[0], lora_a.shape[0])]


@torch.library.custom_op("meshrl::lora_group_backward", mutates_args=())
def lora_group_backward(dys: list[torch.Tensor], x: torch.Tensor, z: torch.Tensor, weights: list[torch.Tensor],
                        lora_a: torch.Tensor, lora_b: list[torch.Tensor], scalings: list[float],
                        need_x: bool) -> list[torch.Tensor]:
    """[dx [T, in] (an empty tensor when x needs none), dA [R, in], dB_1 [out_1, r_1], ..., dB_k]. No [out, in]
    product: the base weights are frozen."""
    dzs, d_bs, start = [], [], 0
    for dy, b, scaling in zip(dys, lora_b, scalings):
        dzs.append(torch.mm(dy, b) * scaling)                                        # [T, r_i]
        d_bs.append(torch.mm(dy.t(), z[:, start:start + b.shape[1]]) * scaling)     # [out_i, r_i]
        start += b.shape[1]
    dz = torch.cat(dzs, dim=1)                                                       # [T, R]
    d_a = torch.mm(dz.t(), x)                                                        # [R, in]: x read once
    if not need_x:
        return [x.new_empty(0), d_a] + d_bs
    pairs = [(dz, lora_a)] + list(zip(dys, weights))
    if lora_linear.base_first(x):
        pairs = pairs[1:] + pairs[:1]
    dx = torch.mm(*pairs[0])                                                         # [T, in], written once
    for left, right in pairs[1:]:
        dx.addmm_(left, right)                                                       # the rest accumulate onto it
    return [dx, d_a] + d_bs


@lora_group_backward.register_fake
def _(dys, x, z, weights, lora_a, lora_b, scalings, need_x):
    dx = x.new_empty(x.shape) if need_x else x.new_empty(0)
    return [dx, lora_a.new_empty(lora_a.shape)] + [b.new_empty(b.shape) for b in lora_b]


def _setup_context(ctx, inputs, output):
    x, weights, biases, lora_a, lora_b, scalings = inputs
    ctx.mark_non_differentiable(output[-1])
    ctx.save_for_backward(x, output[-1], lora_a, *weights, *lora_b)
    ctx.scalings, ctx.num, ctx.biases = scalings, len(weights), len(biases)


def _backward(ctx, grads):
    x, z, lora_a, *rest = ctx.saved_tensors
    weights, lora_b = rest[:ctx.num], rest[ctx.num:]
    if any(ctx.needs_input_grad[1]) or any(ctx.needs_input_grad[2]):
        raise RuntimeError("lora_group: the base weights and biases are frozen; this op never computes their grads")
    need_x = ctx.needs_input_grad[0]
    dys = [x.new_zeros(x.shape[0], w.shape[0]) if g is None else g.contiguous()
           for g, w in zip(grads[:ctx.num], weights)]                              # a member's output unused: zeros
    dx, d_a, *d_bs = torch.ops.meshrl.lora_group_backward(dys, x, z, weights, lora_a, lora_b, ctx.scalings, need_x)
    return (dx if need_x else None), [None] * ctx.num, [None] * ctx.biases, d_a, d_bs, None


lora_group.register_autograd(_backward, setup_context=_setup_context)


def grouped_linear(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None],
                   lora_a: list[torch.Tensor], lora_b: list[torch.Tensor], scalings: list[float]) -> list[torch.Tensor]:
    """[base_i(x) + s_i B_i(A_i(x))] for x [..., in] in the compute dtype (see lora_linear.adapted_linear: the fp32
    adapters are cast to it here, their gradients come back in fp32), one op for every member."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    lead = x.shape[:-1]
    if all(b is None for b in biases):
        biases = []
    else:                                   # some members have a bias, some not (none of the usual models): zeros
        biases = [(w.new_zeros(w.shape[0]) if b is None else b).to(dtype) for w, b in zip(weights, biases)]
    ys = lora_group(x.reshape(-1, x.shape[-1]).to(dtype), [w.to(dtype) for w in weights], biases,
                    torch.cat(lora_a).to(dtype),
                    [b.to(dtype) for b in lora_b], scalings)
    return [y.view(*lead, y.shape[-1]) for y in ys[:-1]]
