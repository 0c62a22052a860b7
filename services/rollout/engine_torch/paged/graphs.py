"""CUDA graphs of the paged decode step's forward (rollout.kv_cache_cuda_graphs): one captured graph per batch
bucket runs the model on one token per row, attention by the Triton kernel over block tables, from static
buffers; each step the host copies in the rows' tokens, positions, block tables and context lengths, then replays;
inside a window of steps (window.py) the sampled tokens are copied in on the device and positions and context
lengths advance there, so a step needs nothing from the host. Sampling is outside the graph (sample.py), as on
the eager paged step.

The step is forward.DecodeStep: the unpaged graph decoder's layers (fused q/k/v and gate/up GEMMs, LoRA by group,
the layer body compiled with `compile`), this cache's KV write and paged attention.

Rows are padded up to the bucket with dummy rows that read and write one scratch block the pool never hands out.
With LoRA adapters served (lora.py), each row's adapter slot is copied into the bank's static row buffer before the
replay (the captured step builds its adapter mask from it by address; dummy rows are the base model's, slot 0).
Graphs read parameters by address: fused parameters swapped by reference go back into their buffers first
(refresh_weights); other weights swapped by reference drop the graphs (captured again).
use_graphs=False runs the same static step without capture (the CPU tests of the padding, with torch attention).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from services.rollout.engine_torch.graph_step import capture
from services.rollout.engine_torch.lora import bank_of
from services.rollout.engine_torch.paged import cascade
from services.rollout.engine_torch.paged.forward import DecodeStep
from services.rollout.engine_torch.paged.kv import PagedKV
from services.rollout.types import bucket_batch

log = logging.getLogger("meshrl.rollout")


@dataclass
class _Bucket:
    ids: torch.Tensor             # [B, 1]
    pos: torch.Tensor             # [B, 1]
    tab: torch.Tensor             # [B, width]
    ctx: torch.Tensor             # [B]
    share: tuple[torch.Tensor, torch.Tensor] | None = None    # lo [B], groups [NG, RG] (cascade.py)
    out: torch.Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None


class PagedGraphs:
    """The decode step's forward per batch bucket, captured once and replayed."""

    def __init__(self, model, kv: PagedKV, *, width: int, scratch_block: int, max_batch_size: int,
                 use_graphs: bool = True, kernel: bool = True, compile: bool = False, step: DecodeStep | None = None,
                 shared_prefix: bool = True):
        self.model, self.kv, self.width, self.scratch = model, kv, width, scratch_block
        self.max_batch_size, self.use_graphs, self.kernel = max_batch_size, use_graphs, kernel
        # The step the graphs capture (one the decoder's eager steps share, when given: same fused buffers).
        self.step = step if step is not None else DecodeStep(model, kv, kernel=kernel, compile=compile)
        assert self.step.kv is kv and self.step.kernel == kernel
        self.device = kv.k[0].device
        self.adapters = bank_of(model)                  # its `rows` buffer: each batch row's adapter slot
        # Rows sharing a prompt's blocks (a GRPO group) read them once per group (cascade.py): with the kernel, where
        # a group program's query tile holds two rows or more.
        self.per_group = cascade.rows_per_group(self.step.num_heads, self.step.num_kv)
        self.shared_prefix = shared_prefix and kernel and self.per_group >= 2
        # Per (batch bucket, groups or not): a window without groups replays the step without the group kernel.
        self._buckets: dict[tuple[int, bool], _Bucket] = {}
        self._pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self._signature = self._weights()
        # shared_prefix_rows: rows that read a prefix through their group, summed over windows (their first steps).
        self.stats = {"graphs_captured": 0, "replays": 0, "shared_prefix_rows": 0}
        self._last: tuple[int, int, bool] | None = None     # (rows, bucket, groups) of the last forward

    def _weights(self) -> tuple[int, ...]:
        return tuple(p.data_ptr() for p in self.model.parameters())

    @torch.inference_mode()
    def forward(self, ids: list[int] | torch.Tensor, pos: list[int] | None, tables: torch.Tensor | None,
                slots: list[int] | None = None, host_tables: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [R, V] (the model's dtype) after feeding ids[r] at pos[r] of row r, whose blocks are tables[r] ([R, w],
        host or device; host_tables: the host copy of device tables, which the groups of shared prefixes are found in),
        with adapter slots[r] (None: the base model's rows). ids: host ints, or a device tensor [R] (a window's
        sampled tokens, fed back without a host round trip). pos and tables None: the previous call's rows, each one
        token further (a window's next step: positions and context lengths advanced on the device, tables kept, and
        the groups: their prefixes are blocks before every member's first position)."""
        if pos is not None:                                                # not inside a window
            self.step.refresh_weights()                 # before the pointers are compared: they move back there
        if self.use_graphs and pos is not None and self._weights() != self._signature:
            log.info("paged KV graphs: parameters moved; capturing again")
            self._buckets.clear()
            self._pool = torch.cuda.graph_pool_handle()
            self._signature = self._weights()
        R = len(ids)
        B = bucket_batch(R, max(self.max_batch_size, R))
        if self.adapters is not None and pos is not None:
            # A capture (and a replay) reads the bank's static rows, all B of them: rows past R (dummies) are
            # zeroed, the base model's.
            assert self.adapters.current is self.adapters.rows and B <= self.adapters.rows.numel()
            self.adapters.set_decode_rows(slots if slots is not None else [])
        if pos is None:
            assert self._last is not None and self._last[:2] == (R, B), "a window's next step needs the previous step's rows"
            b = self._bucket(B, self._last[2])
            b.ids[:R, 0].copy_(ids)
            b.pos[:R] += 1
            b.ctx[:R] += 1
        else:
            found = self._groups(B, pos, host_tables if host_tables is not None else tables)
            b = self._bucket(B, found is not None)
            self._load(b, R, ids, pos, tables)
            if found is not None:
                self._load_groups(b, R, found)
        self._last = (R, B, b.share is not None)
        if b.graph is None:
            b.out = self._step(b)
        else:
            b.graph.replay()
            self.stats["replays"] += 1
        return b.out[:R]

    def _load(self, b: _Bucket, R: int, ids, pos: list[int], tables: torch.Tensor) -> None:
        """The rows' inputs into the bucket's static buffers (one copy each from the host, queued without a host
        sync: the window before may still run; device ids copied)."""
        B = b.ids.size(0)
        pos_h = torch.zeros((B, 1), dtype=torch.long)
        pos_h[:R, 0] = torch.tensor(pos, dtype=torch.long)
        if isinstance(ids, torch.Tensor):
            b.ids[R:].zero_()
            b.ids[:R, 0].copy_(ids)
        else:
            ids_h = torch.zeros((B, 1), dtype=torch.long)
            ids_h[:R, 0] = torch.tensor(ids, dtype=torch.long)
            copy_from_host(b.ids, ids_h)
        copy_from_host(b.pos, pos_h)
        copy_from_host(b.ctx, pos_h[:, 0] + 1)
        # Only the rows' own blocks are copied (a table entry past a row's context is never read); dummy rows
        # (position 0) read their first entry, the scratch block.
        if tables.device.type == "cpu":
            copy_from_host(b.tab[:R, :tables.size(1)], tables)
        else:
            b.tab[:R, :tables.size(1)].copy_(tables)
        b.tab[R:, 0].fill_(self.scratch)

    def _groups(self, B: int, pos: list[int], tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rows' groups of shared prefixes (cascade.share_groups), as many as bucket B's buffer holds; None: none,
        none long enough to pay for the group kernel (cascade.worth_sharing), or the host tables are not at hand."""
        if not self.shared_prefix or tables.device.type != "cpu":
            return None
        found = cascade.share_groups(tables, torch.tensor(pos), self.kv.block_size, self.per_group,
                                     cascade.max_groups(B))
        return found if found is not None and cascade.worth_sharing(found[0]) else None

    def _load_groups(self, b: _Bucket, R: int, found: tuple[torch.Tensor, torch.Tensor]) -> None:
        """The groups into the bucket's static buffers (rows past R, dummies: in none)."""
        lo, groups = b.share
        lo_h = torch.zeros(lo.size(0), dtype=torch.long)
        lo_h[:R] = found[0]
        self.stats["shared_prefix_rows"] += int(found[0].count_nonzero())
        copy_from_host(lo, lo_h)
        copy_from_host(groups, found[1])

    def _step(self, b: _Bucket) -> torch.Tensor:
        return self.step(b.ids, b.pos, b.tab, b.ctx, b.share)

    def _bucket(self, B: int, share: bool = False) -> _Bucket:
        b = self._buckets.get((B, share))
        if b is not None:
            return b
        kw = dict(dtype=torch.long, device=self.device)
        b = _Bucket(torch.zeros((B, 1), **kw), torch.zeros((B, 1), **kw),
                    torch.full((B, self.width), self.scratch, **kw), torch.ones(B, **kw))
        if share:
            b.share = (torch.zeros(B, **kw), torch.full((cascade.max_groups(B), self.per_group), -1, **kw))
        if self.use_graphs:
            # Warm-up on a side stream (cuBLAS handles, Triton compile, allocator) before capture.
            side = torch.cuda.Stream(device=self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._step(b)
            torch.cuda.current_stream(self.device).wait_stream(side)
            b.graph = torch.cuda.CUDAGraph()
            with capture(b.graph, self._pool):
                b.out = self._step(b)
            self.stats["graphs_captured"] += 1
            log.info("paged KV graphs: captured the decode forward for batch=%d%s", B, " (shared prefixes)" * share)
        self._buckets[B, share] = b
        return b


def copy_from_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) for a CPU tensor src: into CUDA from pinned memory, queued on the stream without a host sync."""
    if dst.is_cuda:
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)
