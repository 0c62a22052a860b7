"""Batched LoRA for the torch engine: adapters served unmerged over the frozen base, rows of several adapters (and of
the base model) in one batch.

Each target nn.Linear becomes a LoraLinear in place (its class swapped: same parameters under the same names, so
full-weight updates, named_weights and the graph decoder's weight reads are unchanged). It holds every adapter slot
stacked: A_cat [S * r, in] and B_cat [out, S * r], slot s in columns s*r .. (s+1)*r, the scale alpha / rank folded
into B, smaller ranks zero-padded, slot 0 all zeros (the base model's rows). A forward reads each batch row's slot
from the bank and adds ((x @ A_cat^T) * onehot(slot of row)) @ B_cat^T: two GEMMs over S * r columns (a few dozen),
no per-row weight gathers, static shapes.

Layers that read one input (q/k/v, gate/up: GROUPS) share a LoraGroup: one A [k * S * r, in] stacking the k adapted
members' A_cat, one block-diagonal B [sum of the members' out, k * S * r] (zeros off the blocks); each member's A_cat
and B_cat are views of it. The graph decoder (graph_step.py) applies a whole group with one shrink GEMM (the group's
A sits under the members' fused weights, LoraGroup.under_base_rows, so their base GEMM is the shrink too), one mask
multiply (the mask built once per step: step_mask) and one expand GEMM whose output lines up with the fused
projection's (q|k|v, gate|up); eager forwards keep the per-layer delta. CUDA graphs capture either as it is; a load
copies into the same buffers (through the views), so captured graphs stay valid.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from services.common.tensors.fused import host_to_device
from services.rollout.engine_torch.lora_load import PREFIX, SlotWriter, rank_and_scale
from services.rollout.types import check_weight_version

log = logging.getLogger("meshrl.rollout")

# The linear layers an adapter may target when the recipe names none (every projection of a decoder layer).
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Linear layers of one module that read the same input, in the order a fused projection stacks their outputs
# (graph_step.py's q/k/v GEMM): one shrink and one expand GEMM serve all of them. Any other target is a group alone.
QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")
GROUPS = (QKV, GATE_UP)


class LoraLinear(nn.Linear):
    """An nn.Linear plus the bank's stacked adapters (set by AdapterBank; plain attributes, not parameters)."""

    _lora_bank: "AdapterBank"
    lora_A_cat: torch.Tensor       # [S * r, in]
    lora_B_cat: torch.Tensor       # [out, S * r], scale folded in

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self._lora_bank.base_only(x):
            return y
        if y.requires_grad:                      # autograd: no in-place update of a tensor it may save
            return y + self.lora_delta(x)
        # The expand GEMM accumulates onto the base output in place (beta = 1: read in its epilogue), instead of
        # writing a delta and adding it in a pass of its own: a prefill of 16k tokens made 196 such passes over
        # [tokens, out] tensors at the 1.5B shape.
        y2 = y.view(-1, y.shape[-1])
        y2.addmm_(self._masked_shrink(x).reshape(-1, self.lora_A_cat.shape[0]), self.lora_B_cat.t())
        return y

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        """scale * B_s A_s x for each row's slot s (zero for slot 0), x [N, ..., in]."""
        return F.linear(self._masked_shrink(x), self.lora_B_cat)

    def _masked_shrink(self, x: torch.Tensor) -> torch.Tensor:
        """x A_cat^T with each row's columns outside its slot zeroed, [N, ..., S*r]."""
        rows = self._lora_bank.current
        n = x.shape[0]
        h = F.linear(x, self.lora_A_cat)                                          # [N, ..., S*r]
        mask = (rows[:n, None] == self._lora_bank.column_slot).to(h.dtype)      # [N, S*r]
        return h * mask.view(n, *([1] * (x.dim() - 2)), -1)


@dataclass
class LoraGroup:
    """The stacked adapters of the layers of one module that read one input (a GROUPS entry, or one layer alone); the
    members' own A_cat / B_cat are views of these, so a load writes both."""

    A: torch.Tensor      # [k * W, in]: the k adapted members' A_cat, in GROUPS order (W = S * r)
    B: torch.Tensor      # [sum of every member's out, k * W]: member j's B_cat at its rows, columns j*W.., else zeros
    adapted: list[nn.Module]                # the k adapted members, in A's order
    stacked: torch.Tensor | None = None     # [rows + k * W, in] once asked for (under_base_rows): A is its tail

    def under_base_rows(self, rows: int) -> torch.Tensor:
        """A buffer of `rows` rows for the caller's fused base weight (fused_weights.py) over A, so one GEMM
        gives the base output and the shrink: allocated once and shared by every caller; A and the members' A_cat
        become views of its tail (loads write there). Call before a graph captures A."""
        if self.stacked is None:
            buf = torch.empty((rows + self.A.shape[0], self.A.shape[1]), dtype=self.A.dtype, device=self.A.device)
            buf[rows:].copy_(self.A)
            self.A, self.stacked = buf[rows:], buf
            W = self.A.shape[0] // len(self.adapted)
            for j, m in enumerate(self.adapted):
                m.lora_A_cat = self.A[j * W:(j + 1) * W]
        if self.stacked.shape[0] != rows + self.A.shape[0]:
            raise ValueError(f"LoraGroup.under_base_rows: {rows} rows asked, {self.stacked.shape[0]} - "
                             f"{self.A.shape[0]} held")
        return self.stacked


def masked_expand(h: torch.Tensor, B: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A group's shrink output h [N, ..., k * W] (x @ A^T) kept in each row's slot columns, then expanded by B;
    mask [N, >= k * W] is AdapterBank.step_mask (periodic in W, so its first k * W columns serve a group of k)."""
    n = h.shape[0]
    return F.linear(h * mask[:, :h.shape[-1]].view(n, *([1] * (h.dim() - 2)), -1), B)


def grouped_delta(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A group's adapter delta for each row's slot, x [N, ..., in] -> [N, ..., out of the group]: one shrink GEMM,
    the mask, one expand GEMM (masked_expand)."""
    return masked_expand(F.linear(x, A), B, mask)


def adapter_targets(model: nn.Module, targets: Sequence[str]) -> dict[str, nn.Linear]:
    """The decoder layers' linear layers named by `targets` (last part of the module path, as peft matches)."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets and ".layers." in f".{name}":
            out[name] = m
    return out


class AdapterBank(SlotWriter):
    """The adapters one engine serves: up to max_loras named slots over the model's target layers (loads written by
    SlotWriter, lora_load.py)."""

    def __init__(self, model: nn.Module, *, max_loras: int, max_rank: int, targets: Sequence[str],
                 max_rows: int):
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.max_loras, self.max_rank = max_loras, max_rank
        self.layers = adapter_targets(model, targets)
        if not self.layers:
            raise ValueError(f"rollout.enable_lora: no linear layer of the model matches {list(targets)}")
        width = (max_loras + 1) * max_rank
        self.column_slot = torch.arange(width, device=self.device) // max_rank       # slot of each column
        # The decode rows' slots: static, so a captured graph reads them by address; zero = base rows.
        self.rows = torch.zeros(max_rows, dtype=torch.long, device=self.device)
        self.current = self.rows                                                    # what forwards read
        self.slots: dict[str, int] = {}
        self.versions: dict[str, int] = {}
        self.configs: dict[str, dict] = {}
        # Which load of each adapter is served (numbered across all loads): a reload, even under the same version,
        # is other weights to whatever cached KV computed under the one before (the paged cache's keys).
        self.load_ids: dict[str, int] = {}
        self._num_loads = 0
        # {PEFT's saved name: (module path, 0 = lora_A / 1 = lora_B)} of every tensor an adapter may carry.
        self._names = {f"{PREFIX}{p}.lora_{w}.weight": (p, j) for p in self.layers for j, w in enumerate("AB")}
        self._views: dict[int, tuple] = {}          # per slot, the views its last load wrote (_slot_views)
        for m in self.layers.values():
            m.__class__ = LoraLinear
            m._lora_bank = self
        self.width = width
        self.groups = self._build_groups(model)
        # The graph step's row mask, built once per step for every group: the slot of each column, k_max times over.
        widest = max(g.A.shape[0] for g in self.groups.values()) // width
        self._group_column_slot = self.column_slot.repeat(widest)
        mib = sum(t.numel() for t in self.buffers()) * p.element_size()
        log.info("rollout: LoRA serving on %d layers (%s), %d adapter slots of rank <= %d (%.1f MiB)",
                 len(self.layers), ",".join(sorted({n.rsplit(".", 1)[-1] for n in self.layers})), max_loras, max_rank,
                 mib / 2**20)

    def _build_groups(self, model: nn.Module) -> dict[tuple[int, tuple[str, ...]], LoraGroup]:
        """{(id of the parent module, member names): its LoraGroup} over every target layer; each member's A_cat and
        B_cat set to its views. The B's of groups alike (the same members of the same shapes: one group per decoder
        layer) are one buffer [n, rows, k * W], each group's B one of its n (`b_stacks`, for SlotWriter's loads)."""
        found: dict[tuple[int, tuple[str, ...]], tuple[list[nn.Module], list[str]]] = {}
        for path, m in self.layers.items():
            parent_path, leaf = path.rsplit(".", 1)
            parent = model.get_submodule(parent_path)
            names = next((g for g in GROUPS if leaf in g), (leaf,))
            members = [getattr(parent, n, None) for n in names]
            if not all(isinstance(x, nn.Linear) and x.in_features == m.in_features for x in members):
                names, members = (leaf,), [m]
            found.setdefault((id(parent), names), (members, [f"{parent_path}.{n}" for n in names]))
        alike: dict[tuple, list] = {}
        for key, (members, paths) in found.items():
            shape = tuple((x.in_features, x.out_features, p in self.layers) for x, p in zip(members, paths))
            alike.setdefault((key[1], shape), []).append(key)
        groups: dict[tuple[int, tuple[str, ...]], LoraGroup] = {}
        self.b_stacks = [self._stack_groups(keys, found, groups) for keys in alike.values()]
        return {key: groups[key] for key in found}

    def _stack_groups(self, keys: list, found: dict, groups: dict) -> tuple:
        """The groups `keys` (alike) made over one stacked B buffer, into `groups`; their b_stacks entry."""
        W = self.width
        members, paths = found[keys[0]]
        adapted = [p in self.layers for p in paths]
        k, rows = sum(adapted), sum(x.out_features for x in members)
        stack = torch.zeros((len(keys), rows, k * W), dtype=self.dtype, device=self.device)
        for i, key in enumerate(keys):
            members = found[key][0]
            A = torch.zeros((k * W, members[0].in_features), dtype=self.dtype, device=self.device)
            row = j = 0
            for x, on in zip(members, adapted):
                if on:
                    x.lora_A_cat = A[j * W:(j + 1) * W]
                    x.lora_B_cat = stack[i, row:row + x.out_features, j * W:(j + 1) * W]
                    j += 1
                row += x.out_features
            groups[key] = LoraGroup(A, stack[i], [x for x, on in zip(members, adapted) if on])
        copies, row, j = [], 0, 0
        for n, (x, on) in enumerate(zip(members, adapted)):
            if on:
                copies.append((slice(row, row + x.out_features), j * W, [found[key][1][n] for key in keys]))
                j += 1
            row += x.out_features
        return stack, copies

    def group(self, parent: nn.Module, names: Sequence[str]) -> LoraGroup | None:
        """The group of `parent`'s layers `names` (e.g. an attention module's QKV); None when none of them is adapted
        (or they are not one group here)."""
        return self.groups.get((id(parent), tuple(names)))

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer the bank allocated (the groups' A and B; the layers' A_cat / B_cat are views of them)."""
        return [t for g in self.groups.values() for t in (g.A, g.B)]

    # ---- rows

    def step_mask(self, n: int) -> torch.Tensor:
        """[n, k_max * W] in the model's dtype: 1 where a column belongs to row i's slot (built once per graph step,
        read by every group's grouped_delta)."""
        return (self.current[:n, None] == self._group_column_slot).to(self.dtype)

    def base_only(self, x: torch.Tensor) -> bool:
        """Whether a forward of x is base rows only, known without looking at the rows: wider than the rows set
        (a forward outside rows_for and the graph decode, e.g. ComputeLogProbs: the rows are zero between decodes),
        or no adapter loaded on a CPU model (a CUDA one always runs the adapter GEMMs, so captured graphs hold
        them when an adapter arrives later)."""
        return x.shape[0] > self.current.numel() or (not self.slots and x.device.type == "cpu")

    def slot_of(self, name: str) -> int:
        """The slot of adapter `name` ("" = the base model, slot 0); ValueError for one not loaded."""
        if not name:
            return 0
        if name not in self.slots:
            raise ValueError(f"sampling.adapter: {name!r} is not loaded on this replica (loaded: "
                             f"{', '.join(sorted(self.slots)) or 'none'})")
        return self.slots[name]

    def identity(self, slot: int) -> tuple[str, int, int] | None:
        """What a row of `slot` computes with besides the base weights: (adapter name, its version, its load);
        None for the base model's rows (slot 0, or a slot no adapter holds: its columns are zeros)."""
        name = next((n for n, s in self.slots.items() if s == slot), None) if slot else None
        if name is None:
            return None
        return name, self.versions.get(name, 0), self.load_ids[name]

    def identities(self) -> set[tuple[str, int, int]]:
        """The identity of every adapter served now."""
        return {self.identity(s) for s in self.slots.values()}

    @contextmanager
    def rows_for(self, slots: Sequence[int] | torch.Tensor):
        """Forwards inside read these per-row slots (eager forwards: prefill, the eager decode loop)."""
        prev = self.current
        self.current = host_to_device(torch.as_tensor(slots, dtype=torch.long), self.device)
        try:
            yield
        finally:
            self.current = prev

    def set_decode_rows(self, slots: Sequence[int], at: torch.Tensor | None = None) -> None:
        """The graph decode's rows: slots of batch rows `at` (default: rows 0.., the rest base)."""
        t = host_to_device(torch.as_tensor(list(slots), dtype=torch.long), self.device)      # no host sync
        if at is None:
            self.rows.zero_()
            self.rows[:t.numel()].copy_(t)
        else:
            self.rows.index_copy_(0, at, t)

    # ---- loading

    def load(self, name: str, config: Mapping, tensors: Mapping[str, torch.Tensor]) -> int:
        """Adapter `name` into its slot (a free one when new), whole: everything is checked and built before the
        first buffer is written. Returns the slot. Call with no forward running (the engine's swap)."""
        if not name:
            raise ValueError("manifest.adapter: empty (\"\" is the base model)")
        rank, scale = rank_and_scale(config, self.max_rank)
        pairs = self._pairs(tensors, rank)
        slot = self.slots.get(name)
        if slot is None:
            free = sorted(set(range(1, self.max_loras + 1)) - set(self.slots.values()))
            if not free:
                raise ValueError(f"manifest.adapter: {name!r} would be adapter {len(self.slots) + 1}, but this replica "
                                 f"serves rollout.max_loras = {self.max_loras} ({', '.join(sorted(self.slots))})")
            slot = free[0]
        self._write_slot(slot, rank, scale, pairs)
        self.slots[name] = slot
        self.configs[name] = dict(config)
        self._num_loads += 1
        self.load_ids[name] = self._num_loads
        return slot

    def unload(self, name: str) -> bool:
        """Frees adapter `name`'s slot (its columns zeroed, so a row still pointing there reads the base); False when
        it was not loaded. Call with no forward running (the engine's swap)."""
        slot = self.slots.pop(name, None)
        for by_name in (self.versions, self.configs, self.load_ids):
            by_name.pop(name, None)
        if slot is None:
            return False
        self._zero_slot(slot)
        return True

class TorchAdapters:
    """The torch engine's side of RolloutEngine's adapter methods, over its AdapterBank (`self.adapters`, None when
    rollout.enable_lora is off). Call the mutating ones with no decode running: the engine's apply_adapter and
    remove_adapter run them where a weight swap lands."""

    adapters: AdapterBank | None
    weight_version: int
    # The paged KV cache (rollout.kv_cache: paged; paged/decoder.py's PagedDecoder), keyed by adapter too: told of
    # each load and unload.
    _paged = None

    def slot_of(self, adapter: str) -> int:
        """The adapter slot of a request's sampling.adapter ("" = the base model)."""
        if self.adapters is None:
            if adapter:
                raise ValueError(f"sampling.adapter: {adapter!r}, but this replica serves no adapters "
                                 "(rollout.enable_lora is off)")
            return 0
        return self.adapters.slot_of(adapter)

    def load_adapter(self, name: str, version: int, config: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Adapter `name` replaced whole."""
        check_weight_version(version)
        if self.adapters is None:
            raise ValueError("manifest.adapter: this replica serves no adapters (rollout.enable_lora is off)")
        self.adapters.load(name, config, tensors)
        self.adapters.versions[name] = version
        # One run's replica: its version is the newest update applied, base or adapter (samples are tagged by it).
        self.weight_version = version
        if self._paged is not None:        # its KV and pins under the old load go; the base's and the others' stay
            self._paged.adapters_changed(self.weight_version)

    def loaded_adapters(self) -> dict[str, int]:
        return dict(self.adapters.versions) if self.adapters else {}

    def unload_adapter(self, name: str) -> bool:
        """Adapter `name`'s slot freed for another adapter; False when it was not loaded."""
        if self.adapters is None:
            raise ValueError("unload_adapter: this replica serves no adapters (rollout.enable_lora is off)")
        unloaded = self.adapters.unload(name)
        if unloaded and self._paged is not None:
            self._paged.adapters_changed(self.weight_version)
        return unloaded


def build_bank(settings, model, resolved, max_rows: int) -> AdapterBank | None:
    """rollout.enable_lora (auto: on when the recipe's actor.lora is set) and the bank's sizes, resolved once and
    said out loud; None when off."""
    r, hint = settings.rollout, settings.actor.lora
    on = resolved.pick("rollout.enable_lora", r.enable_lora, hint is not None,
                       "the recipe trains adapters (actor.lora)" if hint is not None else "no actor.lora in the recipe")
    if not on:
        return None
    rank = resolved.pick("rollout.max_lora_rank", r.max_lora_rank, int((hint or {}).get("rank", 16)),
                         "actor.lora.rank" if hint and "rank" in hint else "vLLM's default")
    targets = r.lora_target_modules or list((hint or {}).get("target_modules") or DEFAULT_TARGETS)
    return AdapterBank(model, max_loras=r.max_loras, max_rank=rank, targets=targets, max_rows=max_rows)


@contextmanager
def adapter_rows(bank: AdapterBank | None, slots):
    """bank.rows_for(slots), or nothing without a bank (an engine serving no adapters)."""
    if bank is None:
        yield
        return
    with bank.rows_for(slots):
        yield


def bank_of(model: nn.Module) -> AdapterBank | None:
    """The bank serving adapters on `model`, if one was built on it."""
    return next((m._lora_bank for m in model.modules() if isinstance(m, LoraLinear)), None)
