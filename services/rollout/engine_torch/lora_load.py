"""Writing an adapter into a slot of the torch engine's AdapterBank (lora.py): every name, the rank and every shape
checked before the first buffer is written, then the A's and the scaled B's copied in a few batched calls.

An adapter of the 1.5B shape is 392 tensors, and a GPU replica pays host time per torch call (a launch each), so the
load is batched: the A's in one foreach copy; on a GPU, each projection's B of every layer in one stacked multiply and
one copy into the bank's stacked B buffer (AdapterBank.b_stacks: the B's of groups alike share one buffer), what is
left in one foreach multiply and copy. On a CPU, memory-bound, each product goes straight into its columns.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch

PREFIX = "base_model.model."


class SlotWriter:
    """AdapterBank's loading half (a mixin: the bank holds the layers, buffers and tables it reads)."""

    layers: dict
    device: torch.device
    dtype: torch.dtype
    max_rank: int
    # {PEFT's saved name: (module path, 0 = lora_A / 1 = lora_B)} of every tensor an adapter may carry.
    _names: dict[str, tuple[str, int]]
    _views: dict[int, tuple]                  # per slot, the views its last load wrote (_slot_views)
    # [(stack [n, rows, k * W], [(rows of a member, its first column, its layer's path in each of the n groups)])]
    b_stacks: list[tuple[torch.Tensor, list[tuple[slice, int, list[str]]]]]
    # The devices whose loads write the B's batched (launch-bound); elsewhere (memory-bound) one pass per layer.
    batched_b_devices = ("cuda",)

    def _pairs(self, tensors: Mapping[str, torch.Tensor], rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{module path: (A [r, in], B [out, r])} from PEFT's saved names, each shape checked: a name is one lookup in
        the table of those this bank takes (an adapter has hundreds), parsed only to say why one is refused."""
        parts: dict[str, list] = {}
        for key, t in tensors.items():
            hit = self._names.get(key)
            if hit is None:
                refuse_name(key)
            parts.setdefault(hit[0], [None, None])[hit[1]] = t
        out = {}
        for path, (a, b) in parts.items():
            m = self.layers[path]
            if a is None or b is None:
                raise ValueError(f"manifest.tensors: {path} has lora_A or lora_B alone")
            if a.shape != (rank, m.in_features) or b.shape != (m.out_features, rank):
                raise ValueError(f"manifest.tensors: {path} lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not "
                                 f"fit rank {rank} on a {m.in_features} -> {m.out_features} layer")
            out[path] = (a, b)
        return out

    @torch.no_grad()
    def _write_slot(self, slot: int, rank: int, scale: float, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]
                    ) -> None:
        """Slot `slot` of every layer: A and scale * B of the layers in `pairs` in its first `rank` columns, zeros in
        the rest. Bit for bit the per-layer copy of A and of b.to(float32).mul(scale): each product taken in float32
        (opmath) and rounded once to the bank's dtype; the slot zeroed only where the adapter leaves gaps."""
        if any(t.device != self.device for ab in pairs.values() for t in ab):   # the receivers send device tensors
            pairs = {p: (a.to(self.device), b.to(self.device)) for p, (a, b) in pairs.items()}
        if rank < self.max_rank or len(pairs) < len(self.layers):
            self._zero_slot(slot)
        a_views, b_views = self._slot_views(slot, rank, tuple(pairs))
        if a_views:
            torch._foreach_copy_(a_views, [a for a, _ in pairs.values()])
        # A float32 B, or a bf16 / fp16 one in the bank's dtype, is multiplied in float32 (opmath) and rounded once;
        # any other dtype goes through float32 first, as b.to(float32) did.
        bs = [b if b.dtype == torch.float32 or b.dtype == self.dtype in (torch.bfloat16, torch.float16)
              else b.to(torch.float32) for _, b in pairs.values()]
        if b_views and self.device.type in self.batched_b_devices:
            stacked = self._write_b_stacked(slot * self.max_rank, rank, scale, dict(zip(pairs, bs)))
            left = [(v, b) for p, v, b in zip(pairs, b_views, bs) if p not in stacked]
            if left:          # one batched multiply and one batched copy (which rounds a float32 product once)
                torch._foreach_copy_([v for v, _ in left], torch._foreach_mul([b for _, b in left], scale))
        else:
            # Memory-bound (CPU): each product straight into its columns, one pass (bench/adapter_sync.py).
            for view, b in zip(b_views, bs):
                torch.mul(b, scale, out=view)

    def _write_b_stacked(self, lo: int, rank: int, scale: float, bs: dict[str, torch.Tensor]) -> set[str]:
        """Of the B's `bs` {path: B}, those of a projection the adapter has in every group of a stack (each decoder
        layer's q_proj, ...) in one dtype: stacked, multiplied and copied into the stack's slot columns, three calls
        per projection instead of a copy launch per layer (a B's columns are strided: no foreach fast path). The paths
        written."""
        done: set[str] = set()
        for stack, members in self.b_stacks:
            for rows, col, paths in members:
                srcs = [bs.get(p) for p in paths]
                if any(t is None for t in srcs) or len({t.dtype for t in srcs}) != 1:
                    continue
                stack[:, rows, col + lo:col + lo + rank].copy_(torch.stack(srcs).mul_(scale))
                done.update(paths)
        return done

    def _slot_views(self, slot: int, rank: int, paths: tuple[str, ...]) -> tuple[list, list]:
        """The first `rank` columns of `slot` in the A_cat and B_cat of the layers `paths`: those the slot's last load
        made while they still view the layers' current buffers (LoraGroup.under_base_rows moves A), else new ones."""
        layers, held = [self.layers[p] for p in paths], self._views.get(slot)
        if held is None or held[:2] != (rank, paths) or any(
                m.lora_A_cat is not a or m.lora_B_cat is not b for m, a, b in zip(layers, held[2], held[3])):
            lo, hi = slot * self.max_rank, slot * self.max_rank + rank
            held = self._views[slot] = (rank, paths, [m.lora_A_cat for m in layers], [m.lora_B_cat for m in layers],
                                        [m.lora_A_cat[lo:hi] for m in layers], [m.lora_B_cat[:, lo:hi] for m in layers])
        return held[4], held[5]

    @torch.no_grad()
    def _zero_slot(self, slot: int) -> None:
        """Every layer's columns of `slot` zeroed (a row pointing there computes the base model)."""
        lo, end = slot * self.max_rank, (slot + 1) * self.max_rank
        torch._foreach_zero_([m.lora_A_cat[lo:end] for m in self.layers.values()])
        torch._foreach_zero_([m.lora_B_cat[:, lo:end] for m in self.layers.values()])


def refuse_name(key: str) -> None:
    """Raises why adapter tensor `key` is no name in the bank's table (SlotWriter._names)."""
    if key.startswith(PREFIX) and key.endswith((".lora_A.weight", ".lora_B.weight")):
        raise ValueError(f"manifest.tensors: {key!r} targets {key[len(PREFIX):-len('.lora_A.weight')]!r}, which is "
                         "not a LoRA layer of this replica (rollout.lora_target_modules)")
    raise ValueError(f"manifest.tensors: {key!r} is not a LoRA weight under PEFT's saved names "
                     f"({PREFIX}<module>.lora_A.weight / .lora_B.weight)")


def rank_and_scale(config: Mapping, max_rank: int) -> tuple[int, float]:
    """The adapter's rank and output scale (peft's: alpha / r, or alpha / sqrt(r) with use_rslora)."""
    try:
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"manifest.adapter_config: needs numbers r and lora_alpha ({e})") from None
    if not 1 <= rank <= max_rank:
        raise ValueError(f"manifest.adapter_config: r = {rank}, but this replica serves ranks 1..{max_rank} "
                         "(rollout.max_lora_rank)")
    return rank, alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
