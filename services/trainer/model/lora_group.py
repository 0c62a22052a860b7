"""LoRA-adapted linears that read one input (q/k/v of attention, gate/up of the MLP) as one opaque op: x is read
once for all their adapters, forward and backward, and each GEMM covers every member at once.

Per member the op computes what meshrl::lora_linear does (services/trainer/model/lora_linear.py: on CUDA the
adapter's part first and the base GEMM accumulating onto it, no frozen weight gradient), over the members side by
side: the output y [T, O] holds member i's in its columns (O the sum of their widths; the caller splits it into
views), z = x A^T [T, R] uses the members' A stacked ([R, in], R the sum of their ranks), and their scaled B's
come as one block-diagonal matrix Bd [O, R] (member i's s_i B_i in its rows and its rank's columns, zeros
elsewhere: built by the caller, in the compiled graph, so the scaling and the fp32 -> bf16 cast are one kernel).
So forward is z = x A^T, y = z Bd^T and the base's y += x W^T, where W is the members' base weights stacked: one
GEMM when they lie side by side in memory (apply_lora's `fuse_bases` puts them there), else one per member onto
its columns. Backward: dz = dy Bd, dBd = dy^T z (autograd keeps Bd's diagonal blocks and scales them), dA = dz^T x,
and x's gradient dz A with dy W accumulated onto it. A group's GEMMs in one training step: 3 forward and 5
backward, where one op per member ran 3k + 1 forward and 4k + 2 backward plus 4k scalings: a step's host work (its
launches) is what a LoRA step waits on on a GPU (bench/results/lora_train_gpu_none_4096.json `lora_host_probe`).

z comes out of the op too (not differentiable; callers drop it), so backward reuses it instead of reading x again:
the group's outputs are what attention and the MLP's activation need in backward, so a recomputing checkpoint runs
the op again anyway and z comes with it for free; selective checkpointing keeps it beside them ([T, R]: small). A lone
linear whose output backward does not need (o_proj, down_proj) keeps lora_linear, which returns y alone so that its
recompute stays dead code.
"""

from __future__ import annotations

import torch

from services.trainer.model import lora_linear


def stacked(weights: list[torch.Tensor]) -> torch.Tensor | None:
    """The members' base weights as one [O, in] tensor when they lie one after another in one storage (a view: no
    copy), else None."""
    first = weights[0]
    if len(weights) == 1:
        return first
    rows, offset, storage = 0, first.storage_offset(), first.untyped_storage().data_ptr()
    for w in weights:
        if (not w.is_contiguous() or w.shape[1] != first.shape[1] or w.storage_offset() != offset
                or w.untyped_storage().data_ptr() != storage):
            return None
        rows, offset = rows + w.shape[0], offset + w.numel()
    return first.as_strided((rows, first.shape[1]), (first.shape[1], 1))


@torch.library.custom_op("meshrl::lora_group", mutates_args=())
def lora_group(x: torch.Tensor, weights: list[torch.Tensor], bias: torch.Tensor | None, lora_a: torch.Tensor,
               lora_b: torch.Tensor, mask: torch.Tensor | None) -> list[torch.Tensor]:
    """[y, z]: y [T, O] = x [W_1; ...; W_k]^T + bias + z' Bd^T for x [T, in], weights[i] [out_i, in] (O = sum out_i),
    bias [O] or None, lora_a [R, in] (the members' A stacked), lora_b = Bd [O, R] (block-diagonal, scaled);
    z = x A^T [T, R], z' = z, or z * mask for mask [T, R] (several adapters' rows in one pass: lora_mixed.py; the
    scalings are in the mask then, not in Bd). All in one dtype."""
    return group_forward(x, weights, bias, lora_a, lora_b, mask)


def group_forward(x: torch.Tensor, weights: list[torch.Tensor], bias: torch.Tensor | None, lora_a: torch.Tensor,
                  lora_b: torch.Tensor, mask: torch.Tensor | None) -> list[torch.Tensor]:
    """meshrl::lora_group's [y, z] (_EagerGroup calls it without the op's dispatch)."""
    z = torch.mm(x, lora_a.t())                                                       # [T, R]
    zm = z if mask is None else z * mask
    base = stacked(weights)
    if base is not None and lora_linear.base_first(x):
        y = torch.mm(x, base.t()) if bias is None else torch.addmm(bias, x, base.t())
        return [y.addmm_(zm, lora_b.t()), z]
    y = torch.mm(zm, lora_b.t()) if bias is None else torch.addmm(bias, zm, lora_b.t())
    if base is not None:
        return [y.addmm_(x, base.t()), z]                       # the base GEMM accumulates onto the adapters' part
    start = 0
    for w in weights:                                           # each member's base GEMM onto its own columns
        y[:, start:start + w.shape[0]].addmm_(x, w.t())
        start += w.shape[0]
    return [y, z]


@lora_group.register_fake
def _(x, weights, bias, lora_a, lora_b, mask):
    return [x.new_empty(x.shape[0], lora_b.shape[0]), x.new_empty(x.shape[0], lora_a.shape[0])]


@torch.library.custom_op("meshrl::lora_group_backward", mutates_args=())
def lora_group_backward(dy: torch.Tensor, x: torch.Tensor, z: torch.Tensor, weights: list[torch.Tensor],
                        lora_a: torch.Tensor, lora_b: torch.Tensor, need_x: bool,
                        mask: torch.Tensor | None) -> list[torch.Tensor]:
    """[dx [T, in] (an empty tensor when x needs none), dA [R, in], dBd [O, R]] for dy [T, O]. No [out, in]
    product: the base weights are frozen."""
    return group_backward(dy, x, z, weights, lora_a, lora_b, need_x, mask)


def group_backward(dy: torch.Tensor, x: torch.Tensor, z: torch.Tensor, weights: list[torch.Tensor],
                   lora_a: torch.Tensor, lora_b: torch.Tensor, need_x: bool,
                   mask: torch.Tensor | None) -> list[torch.Tensor]:
    """meshrl::lora_group_backward's [dx, dA, dBd]."""
    dz = torch.mm(dy, lora_b)                                                         # [T, R]
    if mask is None:
        d_b = torch.mm(dy.t(), z)                                                     # [O, R]
    else:                                     # z' = z * mask: each token's gradient reaches its own adapter's A
        d_b = torch.mm(dy.t(), z * mask)
        dz = dz.mul_(mask)
    d_a = torch.mm(dz.t(), x)                                                         # [R, in]: x read once
    if not need_x:
        return [x.new_empty(0), d_a, d_b]
    base = stacked(weights)
    if base is not None and lora_linear.base_first(x):
        return [torch.mm(dy, base).addmm_(dz, lora_a), d_a, d_b]
    dx, start = torch.mm(dz, lora_a), 0                                               # [T, in], written once
    for w in [base] if base is not None else weights:
        dx.addmm_(dy[:, start:start + w.shape[0]], w)                                 # the base's accumulate onto it
        start += w.shape[0]
    return [dx, d_a, d_b]


@lora_group_backward.register_fake
def _(dy, x, z, weights, lora_a, lora_b, need_x, mask):
    dx = x.new_empty(x.shape) if need_x else x.new_empty(0)
    return [dx, lora_a.new_empty(lora_a.shape), lora_b.new_empty(lora_b.shape)]


def _setup_context(ctx, inputs, output):
    x, weights, bias, lora_a, lora_b, mask = inputs
    ctx.mark_non_differentiable(output[-1])
    ctx.set_materialize_grads(False)                  # z's gradient is never made (no zeros kernel for it)
    ctx.save_for_backward(x, output[-1], lora_a, lora_b, mask, *weights)


def _backward(ctx, grads):
    dy = grads[0]
    x, z, lora_a, lora_b, mask, *weights = ctx.saved_tensors
    if any(ctx.needs_input_grad[1]) or ctx.needs_input_grad[2] or ctx.needs_input_grad[5]:
        raise RuntimeError("lora_group: the base weights, biases and the adapters' mask are fixed; this op never "
                           "computes their grads")
    need_x = ctx.needs_input_grad[0]
    dy = x.new_zeros(x.shape[0], lora_b.shape[0]) if dy is None else dy.contiguous()
    dx, d_a, d_b = torch.ops.meshrl.lora_group_backward(dy, x, z, weights, lora_a, lora_b, need_x, mask)
    return (dx if need_x else None), [None] * len(weights), None, d_a, d_b, None


lora_group.register_autograd(_backward, setup_context=_setup_context)


class _EagerGroup(torch.autograd.Function):
    """meshrl::lora_group's y with its backward as an autograd.Function (where lora_linear.eager())."""

    @staticmethod
    def forward(ctx, x, bias, lora_a, lora_b, mask, *weights):
        y, z = group_forward(x, list(weights), bias, lora_a, lora_b, mask)
        ctx.save_for_backward(x, z, lora_a, lora_b, mask, *weights)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, z, lora_a, lora_b, mask, *weights = ctx.saved_tensors
        if any(ctx.needs_input_grad[5:]) or ctx.needs_input_grad[1] or ctx.needs_input_grad[4]:
            raise RuntimeError("lora_group: the base weights, biases and the adapters' mask are fixed; this op never "
                               "computes their grads")
        need_x = ctx.needs_input_grad[0]
        dx, d_a, d_b = group_backward(dy.contiguous(), x, z, weights, lora_a, lora_b, need_x, mask)
        return (dx if need_x else None), None, d_a, d_b, None, *[None] * len(weights)


def group(x: torch.Tensor, weights: list[torch.Tensor], bias: torch.Tensor | None, lora_a: torch.Tensor,
          lora_b: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """y of meshrl::lora_group: _EagerGroup where lora_linear.eager(), else the op."""
    if lora_linear.eager():
        return _EagerGroup.apply(x, bias, lora_a, lora_b, mask, *weights)
    return lora_group(x, weights, bias, lora_a, lora_b, mask)[0]


def joined_bias(weights: list[torch.Tensor], biases: list[torch.Tensor | None], dtype: torch.dtype):
    """The members' biases as one [O] in `dtype`, or None when none has one (zeros for a member without one where
    others have one: none of the usual models)."""
    if all(b is None for b in biases):
        return None
    return torch.cat([w.new_zeros(w.shape[0]) if b is None else b for w, b in zip(weights, biases)]).to(dtype)


def grouped_linear(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None],
                   lora_a: list[torch.Tensor], lora_b: list[torch.Tensor], scalings: list[float]) -> list[torch.Tensor]:
    """[base_i(x) + s_i B_i(A_i(x))] for x [..., in] in the compute dtype (see lora_linear.adapted_linear: the fp32
    adapters are cast to it here, their gradients come back in fp32), one op for every member; each output a view
    of the op's one [T, O]."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    lead = x.shape[:-1]
    bias = joined_bias(weights, biases, dtype)
    block = torch.block_diag(*[b * s for b, s in zip(lora_b, scalings)]).to(dtype)            # [O, R]
    y = group(x.reshape(-1, x.shape[-1]).to(dtype), [w.to(dtype) for w in weights], bias,
              torch.cat(lora_a).to(dtype), block, None)
    return [part.view(*lead, part.shape[-1]) for part in y.split([w.shape[0] for w in weights], dim=1)]
