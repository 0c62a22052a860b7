"""The decoder layers of a one-token-per-row decode step, shared by the CUDA-graph decoder's step (graph_step.py) and
the paged KV cache's (paged/forward.py DecodeStep): everything but the KV write and attention, which each step gives
as `_attend` (a static [B, kv_heads, S, head_dim] cache there, a pool of slots read through block tables here).

The projections run by group, each one GEMM on a buffer that holds the members' weights (their parameters are views
of it, fused_weights.py): q/k/v and gate/up. With LoRA adapters served (lora.py) the step builds the rows' slot mask
once (step_mask) and every group (o and down alone) has its adapters' A under its weights, so the same GEMM gives the
shrink; then one mask multiply and one block-diagonal expand GEMM, lined up with the group's outputs, added before the
split. The layers' own forwards (and their per-layer adapter deltas) never run here. With `compile`, one layer body
goes through torch.compile and is reused by every layer (regional compilation); attention is one opaque custom op
there (meshrl::decode_attention, meshrl::paged_decode_attention) or plain torch ops.
"""

from __future__ import annotations

import sys
from typing import Sequence

import torch
import torch.nn.functional as F

from services.rollout.engine_torch import lora_expand
from services.rollout.engine_torch.fused_weights import fuse, refresh
from services.rollout.engine_torch.lora import GATE_UP, QKV, LoraLinear, bank_of, grouped_delta, masked_expand


class DecodeLayers:
    """The fused, grouped and (optionally) compiled layers of a one-token decode step; subclasses attend."""

    # The setting that turns the step off, named when the served adapters adapt a layer the step would skip.
    off_setting = "rollout.cuda_graphs: false"

    def __init__(self, model, *, compile: bool):
        self.model = model
        cfg = model.config
        attn = model.model.layers[0].self_attn
        self.num_heads = cfg.num_attention_heads
        self.num_kv = cfg.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        # The model module's own rotary helper (Llama and Qwen2 share the formula).
        self._apply_rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        # torch.compile fuses the ~40 small kernels of each layer (norms, rope, softmax, SiLU, casts) into a few;
        # in a graph every launch still costs a few microseconds, and at decode sizes launches are the time.
        # One layer is compiled and reused by all (regional compilation: seconds, not minutes); default mode,
        # no inductor cudagraphs: the decoder captures the whole step. After the first change of batch (or length)
        # the sizes are compiled dynamic.
        self._layer_fn = torch.compile(self._layer, fullgraph=True) if compile else self._layer
        # LoRA adapters served on this model (rollout.enable_lora): each row's slot is in adapters.current.
        self.adapters = bank_of(model)
        # q/k/v as one GEMM per layer (three small ones were ~10% of a step at batch 512), gate/up likewise: the
        # parameters re-pointed into one buffer each (fused_weights.py; no copies, and one buffer per group however
        # many steps fuse it). With adapters, each group's A sits under its buffer, o's and down's too, so the base
        # GEMM is the shrink as well.
        self._fused = []
        # Which kinds of group the adapters' rows are applied to (_step_mask builds what they read): lora_expand's
        # one kernel, or the torch ops (mask, expand GEMM, add).
        self._by_kernel = self._by_torch = False
        self._silu = getattr(cfg, "hidden_act", None) == "silu"         # the MLP's act_fn (Llama's and Qwen2's)
        self._proj = [self._layer_projections(i, layer) for i, layer in enumerate(model.model.layers)]

    def _layer_projections(self, i: int, layer) -> tuple:
        """The layer's four projection groups (q/k/v, o, gate/up, down) as the step applies them: each
        (fused weight, its bias, A when not under it, the adapters' B, _kernel_args' (sizes, starts, width, rank)
        when lora_expand's kernel applies the adapters), None where absent."""
        bank, a, mlp = self.adapters, layer.self_attn, layer.mlp
        out, covered = [], 0
        for parent, names in ((a, QKV), (a, ("o_proj",)), (mlp, GATE_UP), (mlp, ("down_proj",))):
            group = bank.group(parent, names) if bank is not None else None
            f = fuse([getattr(parent, n) for n in names], group) if group is not None or len(names) > 1 else None
            if f is not None:
                self._fused.append(f)
            kernel = self._kernel_args(parent, names, group) if f is not None else None
            self._by_kernel |= kernel is not None
            self._by_torch |= group is not None and kernel is None
            out.append((f.weight if f else None, f.bias if f else None,
                        group.A if group is not None and f is None else None, group.B if group is not None else None,
                        kernel))
            covered += 0 if group is None else group.A.shape[0] // bank.width
        adapted = sum(isinstance(m, LoraLinear) for m in layer.modules())
        if covered != adapted:          # an adapted layer the step would skip: refuse rather than drop its delta
            raise ValueError(f"rollout.lora_target_modules: layer {i} adapts {adapted} linear layers, the decode "
                             f"step applies {covered} (q/k/v/o/gate/up/down only); set {self.off_setting}")
        return tuple(out)

    def _kernel_args(self, parent, names: Sequence[str], group) -> tuple | None:
        """What lora_expand takes besides tensors for this group (its members' widths, each member's first column in
        the group's B or -1 when not adapted, the bank's slot width and rank); None when its kernel does not serve
        the group (no adapters, no CUDA or Triton, widths no column block divides)."""
        if group is None:
            return None
        members = [getattr(parent, n) for n in names]
        sizes = [m.out_features for m in members]
        if not lora_expand.available(group.B.device, sizes):
            return None
        W = self.adapters.width
        starts = [group.adapted.index(m) * W if m in group.adapted else -1 for m in members]
        return sizes, starts, W, self.adapters.max_rank

    def refresh_weights(self) -> None:
        """After weights were copied into the model (a swap): parameters given other storage go back into the fused
        buffers (in-place copies are there already)."""
        for f in self._fused:
            refresh(f)

    def _step_mask(self, x: torch.Tensor) -> tuple | None:
        """The rows' adapters, once per step for every group of every layer (None: base rows only): (the slot mask
        the torch ops' groups read, the rows' slots lora_expand's read), each None when no group reads it. The rows
        are the bank's current ones: its static rows in a graph (padding rows zero, the base model's)."""
        if self.adapters is None or self.adapters.base_only(x):
            return None
        n = x.shape[0]
        return (self.adapters.step_mask(n) if self._by_torch else None,
                self.adapters.current[:n] if self._by_kernel else None)

    def _layer(self, layer, x: torch.Tensor, cos, sin, proj: tuple, mask: tuple | None,
               *cache) -> torch.Tensor:
        """The function `compile` compiles: each subclass's own, calling _layer_body, so each has a code object of its
        own (torch.compile keeps its compiled graphs and its dynamic-size bookkeeping per code object, and the two
        steps' inputs differ)."""
        raise NotImplementedError

    def _layer_body(self, layer, x: torch.Tensor, cos, sin, proj: tuple, mask: tuple | None,
                    cache: tuple) -> torch.Tensor:
        """One decoder layer for one token per row, x [B, 1, d]. proj: the layer's projection groups
        (_layer_projections), mask: the step's adapter rows (_step_mask; None: base rows only), cache: what _attend takes
        besides q, k, v (the layer's cache and the step's positions)."""
        B, H, KV, hd = x.shape[0], self.num_heads, self.num_kv, self.head_dim
        a, mlp = layer.self_attn, layer.mlp
        q, k, v = self._project(layer.input_layernorm(x), (a.q_proj, a.k_proj, a.v_proj), proj[0], mask)
        q = q.reshape(B, 1, H, hd).transpose(1, 2)                               # [B, H, 1, hd]
        k = k.reshape(B, 1, KV, hd).transpose(1, 2)
        v = v.reshape(B, 1, KV, hd).transpose(1, 2)
        q, k = self._apply_rope(q, k, cos, sin)
        o = self._attend(q, k, v, *cache)                                        # [B, 1, H * hd]
        x = x + self._project(o, (a.o_proj,), proj[1], mask)[0]
        # Llama's and Qwen2's MLP: down(act(gate h) * up h).
        h = self._mlp_act(mlp, layer.post_attention_layernorm(x), proj[2], mask)
        return x + self._project(h, (mlp.down_proj,), proj[3], mask)[0]

    def _mlp_act(self, mlp, x: torch.Tensor, group: tuple, rows: tuple | None) -> torch.Tensor:
        """act(gate x) * up x with the rows' adapter deltas: with SiLU and lora_expand's kernel serving the group,
        one kernel from the group's GEMM (lora_swiglu: the gate/up sum never written), else _project's outputs."""
        w, b, _, B, kernel = group
        if self._silu and kernel is not None and rows is not None:
            y = F.linear(x, w, b)
            return lora_expand.lora_swiglu(y.reshape(-1, y.shape[-1]), B, rows[1], *kernel).view(
                *y.shape[:-1], -1)
        g, u = self._project(x, (mlp.gate_proj, mlp.up_proj), group, rows)
        return mlp.act_fn(g) * u

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *cache) -> torch.Tensor:
        """Writes this token's k, v [B, KV, 1, hd] into the layer's cache and attends q [B, H, 1, hd] to it:
        [B, 1, H * hd]."""
        raise NotImplementedError

    @staticmethod
    def _project(x: torch.Tensor, members: tuple, group: tuple, rows: tuple | None) -> Sequence[torch.Tensor]:
        """Each member's output on x, plus its adapter delta when rows is set (_step_mask's). group: (fused weight,
        bias, A, B, widths) of _layer_projections; without a fused weight, each member's own GEMM and the group's
        shrink."""
        w, b, A, B, kernel = group
        sizes = [m.out_features for m in members]
        if w is not None:
            y = F.linear(x, w, b)                          # the members' base outputs, then (with adapters) x A^T
            if kernel is not None and rows is not None:    # expand and add: one kernel
                out = lora_expand.lora_expand(y.reshape(-1, y.shape[-1]), B, rows[1], *kernel)
                return out.view(*y.shape[:-1], -1).split(sizes, dim=-1)
            out = y[..., :sum(sizes)]
            if B is not None and rows is not None:         # the block-diagonal expand, lined up with the outputs
                out = out + masked_expand(y[..., sum(sizes):], B, rows[0])
            return out.split(sizes, dim=-1)
        outs = [F.linear(x, m.weight, m.bias) for m in members]
        if B is not None and rows is not None:
            outs = [y + d for y, d in zip(outs, grouped_delta(x, A, B, rows[0]).split(sizes, dim=-1))]
        return outs
