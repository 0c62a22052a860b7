"""Several LoRA adapters in one forward and backward: each token under the adapter of its row, so the updates of
several runs on one trainer (services/trainer/updates/merged.py) run as one pass over all their rows, as the rollout
engine's decode already serves every run's rows in one batch.

An adapted linear in mixed mode computes y = x W^T + b + (z * M) B^T with z = x A^T, where A stacks the adapters'
A's ([R, in], R the sum of their ranks), B holds their B's side by side ([out, R]) and M [T, R] is the adapter's
scaling where column r belongs to token t's adapter, else 0. So the frozen base runs one GEMM over every row, and
the adapters two GEMMs of inner size R (the k adapters' rank-r GEMMs as one), each adapter's gradient only from its
own rows (M zeroes the others'). Sibling layers that read one input (q/k/v, gate/up) run as one lora_group op with
the mask (mixed_group), as one adapter's pass runs them. This mode runs in the eager trainer that serves several
runs (a compiled trainer goes eager at its first named adapter: model/adapter_set.py).

The mode is a module-level state, set for one forward and its backward: commands run one at a time
(services/trainer/commands.py), and on CUDA a checkpointed block's recompute runs on autograd's device thread, where
a thread-local would not be seen.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Sequence

import numpy as np
import torch
from torch import nn

from services.common.tensors.packing import token_rows
from services.trainer.model.lora_group import group, joined_bias

_ACTIVE: "MixedRows | None" = None


class MixedRows:
    """The adapters of one forward (`names`) and the index into them of each of its tokens ([T], flattened as the
    model's input: services.common.tensors.packing.token_rows)."""

    def __init__(self, names: Sequence[str], token_adapter: torch.Tensor):
        self.names = list(names)
        self.token_adapter = token_adapter
        self._masks: dict[tuple, torch.Tensor] = {}

    def mask(self, ranks: tuple[int, ...], scalings: tuple[float, ...], dtype: torch.dtype) -> torch.Tensor:
        """M [T, R]: the adapter's scaling where column r (of the adapters' ranks side by side) is token t's
        adapter's, else 0; one per layer shape, shared by every layer of the forward."""
        key = (ranks, scalings, dtype)
        if key not in self._masks:
            idx = self.token_adapter
            onehot = idx[:, None] == torch.arange(len(ranks), device=idx.device)[None, :]
            scaled = onehot * torch.tensor(scalings, dtype=torch.float32, device=idx.device)[None, :]
            self._masks[key] = scaled.to(dtype).repeat_interleave(torch.tensor(ranks, device=idx.device), dim=1,
                                                                  output_size=sum(ranks))
        return self._masks[key]

    def group_mask(self, members: Sequence[tuple[tuple[int, ...], tuple[float, ...]]],
                   dtype: torch.dtype) -> torch.Tensor:
        """[T, R'] for sibling layers, each (ranks, scalings): their masks side by side, as their A's are stacked."""
        key = (tuple(members), dtype)
        if key not in self._masks:
            parts = [self.mask(ranks, scalings, dtype) for ranks, scalings in members]
            self._masks[key] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return self._masks[key]


def active() -> MixedRows | None:
    return _ACTIVE


@contextmanager
def rows(names: Sequence[str], token_adapter: torch.Tensor):
    """Mixed mode for the forward and backward run inside: token t under adapter names[token_adapter[t]]."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("lora_mixed: a mixed forward is already running")
    _ACTIVE = MixedRows(names, token_adapter)
    try:
        yield _ACTIVE
    finally:
        _ACTIVE = None


def by_row(names: Sequence[str], of_row: Sequence[int], prompts, responses, *, packed: bool,
           device: torch.device):
    """`rows` for a micro-batch of prompts + responses laid out as token_layout lays them (packed or padded), row r
    under adapter names[of_row[r]]."""
    token_adapter = np.asarray(of_row, dtype=np.int64)[token_rows(prompts, responses, packed=packed)]
    return rows(names, torch.from_numpy(token_adapter).to(device))


def unmixable(layers: dict[str, nn.Module], names: Sequence[str]) -> str | None:
    """Why these adapters cannot run in one mixed forward, or None: each adapted layer must be a plain linear (a
    frozen nn.Linear base, no LoRA bias, dropout or variant such as DoRA), as the lean forward covers."""
    for layer_name, layer in layers.items():
        base = layer.base_layer
        if not isinstance(base, nn.Linear) or base.weight.requires_grad:
            return f"{layer_name}: not a frozen linear"
        for n in names:
            if n not in layer.lora_A:
                return f"{layer_name}: no adapter {n!r}"
            if (layer.lora_B[n].bias is not None or n in getattr(layer, "lora_variant", {})
                    or not isinstance(layer.lora_dropout[n], nn.Identity)):
                return f"{layer_name}: adapter {n!r} has a bias, dropout or variant"
    return None


def mixed_linear(layer: nn.Module, x: torch.Tensor, mixed: MixedRows) -> torch.Tensor:
    """base(x) + each token's adapter's scaled B(A(x)), in the compute dtype (the autocast dtype under autocast, else
    x's; the fp32 adapters are cast to it and their gradients come back in fp32)."""
    return mixed_group([layer], x, mixed)[0]


def mixed_group(layers: Sequence[nn.Module], x: torch.Tensor, mixed: MixedRows) -> list[torch.Tensor]:
    """mixed_linear for sibling layers that read one x (q/k/v, gate/up: model/lora.py SiblingGroup), through one
    lora_group op (model/lora_group.py `group`) with the mask: A is every member's adapters' A's stacked, Bd
    block-diagonal by member (each member's block its adapters' B's side by side), the mask each member's columns
    of M. One op a group where each layer made seven (their casts, two GEMMs of A and B, the mask, the base, the
    sum), and a backward that never forms the frozen base's weight gradient. It did not make a merged pass faster
    where measured (H100, 0.5B, 4 adapters: 0.69 s against 0.66 s at 21cfb10, within the spread: `earlier_calls` of
    bench/results/lora_merged_train_gpu.json); it runs a merged pass on the same ops as one adapter's."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).to(dtype)
    if x2.shape[0] != mixed.token_adapter.shape[0]:
        raise RuntimeError(f"lora_mixed: {layers[0].__class__.__name__} got {x2.shape[0]} tokens, the mixed rows "
                           f"have {mixed.token_adapter.shape[0]}")
    a = torch.cat([layer.lora_A[n].weight for layer in layers for n in mixed.names]).to(dtype)          # [R', in]
    blocks = [torch.cat([layer.lora_B[n].weight for n in mixed.names], dim=1) for layer in layers]   # [out_i, R]
    b = (blocks[0] if len(blocks) == 1 else torch.block_diag(*blocks)).to(dtype)                    # [O, R']
    mask = mixed.group_mask([(tuple(layer.lora_A[n].weight.shape[0] for n in mixed.names),
                              tuple(float(layer.scaling[n]) for n in mixed.names)) for layer in layers], dtype)
    bases = [layer.base_layer for layer in layers]
    bias = joined_bias([base.weight for base in bases], [base.bias for base in bases], dtype)
    y = group(x2, [base.weight.to(dtype) for base in bases], bias, a, b, mask)
    return [part.view(*lead, part.shape[-1]) for part in y.split([base.weight.shape[0] for base in bases], dim=1)]
