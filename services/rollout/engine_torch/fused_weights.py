"""Fused projection weights for the graph decoder (graph_step.py): the linear layers of one module that read one input
(q/k/v, gate/up) share one weight buffer, their parameters re-pointed to views of it, with the rows of their LoRA
group's A (lora.py, LoraGroup.under_base_rows) below when adapters are served (o and down then get a buffer of their
own for the same reason). One GEMM gives every member's base output and the adapters' shrink.

No copy of the weights is kept: updates copy into the parameters in place (engine.swap_in), so they land in the
buffer and captured graphs see them. A parameter given other storage (swapped by reference) is copied back into its
rows and re-pointed by refresh(), which the decoders run at every decode call and after every swap.

Fusing is per model, not per decoder: the unpaged graph decoder and the paged KV cache's step on one model get the same
buffer (fuse again: the one already built), as parameters can be views of one buffer only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from services.rollout.engine_torch.lora import LoraGroup


@dataclass
class FusedLinear:
    """Linear layers reading one input as one GEMM: weight rows of each member in order, then the group's A."""

    weight: torch.Tensor            # [rows + k * W, in]; the members' weights are views of its first rows
    bias: torch.Tensor | None       # [rows + k * W], zeros under A; None when no member has a bias
    members: list[nn.Linear]
    rows: int                       # the members' out features summed: the base output's width
    group: LoraGroup | None = None  # the adapters whose A is under the rows


# The attribute of each member that holds its FusedLinear.
_FUSED = "_meshrl_fused"


def fuse(members: Sequence[nn.Linear], group: LoraGroup | None) -> FusedLinear | None:
    """members in one buffer over group's A (None: none); None when they cannot share one (some with a bias and some
    without, or other input sizes, dtypes or devices). Members fused already: the same FusedLinear (fusing them
    otherwise, in another grouping or over other adapters, is refused: it would leave the first buffer stale)."""
    members = list(members)
    held = {id(f): f for f in (getattr(m, _FUSED, None) for m in members) if f is not None}
    if held:
        f = next(iter(held.values()))
        if len(held) > 1 or len(f.members) != len(members) or any(a is not b for a, b in zip(f.members, members)) \
                or f.group is not group:
            raise ValueError("fuse: these linear layers are fused already in another group")
        refresh(f)
        return f
    if len({m.bias is not None for m in members}) != 1 or len(
            {(m.in_features, m.weight.dtype, m.weight.device) for m in members}) != 1:
        return None
    rows = sum(m.out_features for m in members)
    ref = members[0].weight
    # Normal tensors even when built under inference mode (a decode step built inside a decode): the parameters
    # become views of them, and refresh writes them outside it.
    with torch.no_grad(), torch.inference_mode(False):
        w = group.under_base_rows(rows) if group is not None else torch.empty(
            (rows, ref.shape[1]), dtype=ref.dtype, device=ref.device)
        b = torch.zeros(w.shape[0], dtype=ref.dtype, device=ref.device) if members[0].bias is not None else None
    f = FusedLinear(w, b, members, rows, group)
    refresh(f)
    for m in members:
        setattr(m, _FUSED, f)
    return f


@torch.no_grad()
def refresh(f: FusedLinear) -> None:
    """Each member's weight and bias that is not a view of its rows (at fuse, or swapped by reference since) copied
    there and re-pointed to them."""
    with torch.inference_mode(False):
        r = 0
        for m in f.members:
            n = m.out_features
            pairs = [(m.weight, f.weight[r:r + n])] + ([(m.bias, f.bias[r:r + n])] if f.bias is not None else [])
            for p, rows in pairs:
                if p.data_ptr() != rows.data_ptr():
                    rows.copy_(p)
                    p.data = rows
            r += n


def members_output(x: torch.Tensor, f: FusedLinear) -> tuple[torch.Tensor, torch.Tensor]:
    """(the members' base outputs side by side [.., rows], the group's shrink x A^T [.., k * W], empty without A)."""
    y = torch.nn.functional.linear(x, f.weight, f.bias)
    return y[..., :f.rows], y[..., f.rows:]
