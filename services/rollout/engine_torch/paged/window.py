"""Windows of paged decode steps with one host sync each (as cuda_decode's `sync_every`): the running rows' blocks for
the window's tokens are reserved up front, then k steps run with each step's tokens fed back on the device (the
sampler's draws, sample.py, straight into the next forward: a CUDA-graph replay whose ids, positions and context
lengths advance on the device, or the eager paged forward), then one sync reads the window's tokens, log-probs and
eos flags and the host does the k steps' bookkeeping: a row that ended inside the window (eos, a stop string, its
budget) keeps its tokens up to its end and lets go of the blocks reserved past it. Admissions, preemptions, weight
swaps and episode ends happen between windows (decoder.py's loop).

A window starts from each row's next token's logits and samples k tokens, feeding the first k - 1 on the device; the
last one is fed by a step launched right after the window (its block reserved with the window's), which runs while
the host reads and settles the window (with k = 1, the loop's own step feeds it after the bookkeeping, as before
windows; a weight swap at the window's end has the new weights feed it again). A pool that cannot hold every row's
window (free and evictable blocks; only unused ones while a preempted row waits to resume from its cached blocks)
shortens it to the steps it can hold, down to k = 1 (rows then grow one token at a time, preempting when dry). Rows
past their end or budget inside a window still run to the window's end: their extra tokens land in blocks reserved
for them (dropped with those blocks) or, past their budget, in the spill block (one block past the pool's, named by
every table entry past a row's blocks).

Chained windows: where the loop needs nothing from a window before the next (no row waits to be admitted, no weight
swap can land between windows, the pool holds the next window), the next window is launched before the host reads
the last one: its blocks reserved as if every row ran all of the last window's steps, its first draw from the
logits of the step after the last window, its host inputs copied without a host sync (pinned memory). The host then
settles the last window while the device runs the next, so the device does not wait for the host's bookkeeping
between windows. A row that ended in the last window runs to the end of the next one too: its tokens there are
dropped, and the blocks reserved for them go back to the pool when the last window is settled (later work that
reuses them is queued after the next window on the same stream).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.common.tensors.fused import host_to_device
from services.rollout.engine_torch.lora import adapter_rows
from services.rollout.engine_torch.paged.blocks import BlockTable
from services.rollout.engine_torch.paged.forward import paged_forward

# Decode steps per host sync (cuda_decode's sync_every).
SYNC_EVERY = 16


@dataclass
class Seq:
    """One row's paged state: its tokens (prompt + response so far) and its blocks."""

    index: int
    tokens: list[int]
    prompt_len: int
    table: BlockTable = field(default_factory=BlockTable)
    # what the next token is sampled from: row i of a [B, V] fp32 batch of logits (a forward's, kept whole)
    logits: tuple[torch.Tensor, int] | None = None
    done: bool = False
    preempted: bool = False                      # waits to resume (its history is fed again, mostly cached)
    cached_prompt: int = -1                      # prompt tokens not prefilled at its first admission (-1: not yet)
    episode: str = ""                            # its episode's id: the table is pinned when it ends
    slot: int = 0                                # its LoRA adapter's slot in the bank (0: the base model)
    key: tuple = ()                              # what its KV was computed with, since its admission (_key)
    answered: bool = False                       # handed over as ended (continuous batching)

    @property
    def response(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def num_response(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclass
class Launched:
    """A window queued on the device and not yet settled."""

    rows: list[Seq]                         # its rows in batch order (some may have ended in an earlier window)
    k: int                                  # its steps
    pending: tuple                          # its draws on their way to the host (StepSampler.snapshot)
    next_logits: torch.Tensor | None        # [R, V] after its last token, from the step after it (None: k = 1)


class HostTables:
    """Every row's block table mirrored in one host tensor [rows, width], written where a table changed (admission,
    a new block, a copy on write), so a decode step's [B, width] tables are one index_select, not B lists. Entries
    past a row's blocks name the spill block (a window's writes past a row's end go there); wide enough for two
    windows past each row's budget (a chained window's rows include rows that ended in the window before it). A table's new entries wait in a dict and land in one index_put_ before the next
    read or cut (a window's reservations are one per row: hundreds of single-entry writes otherwise)."""

    def __init__(self, rows, block_size: int, window: int, spill: int):
        self.block_size, self.window, self.spill = block_size, window, spill
        self.t = torch.full((len(rows), self._width(rows)), spill, dtype=torch.long)
        self._pending: dict[tuple[int, int], int] = {}

    def _width(self, rows) -> int:
        return max(-(-(len(r.prompt) + r.budget + 2 * self.window) // self.block_size) for r in rows)

    def add(self, rows) -> None:
        """Entries for rows that joined the call (the next indices), the tensor widened where they need it."""
        self._flush()
        grow = self._width(rows) - self.t.size(1)
        if grow > 0:
            self.t = torch.cat([self.t, self.t.new_full((self.t.size(0), grow), self.spill)], 1)
        self.t = torch.cat([self.t, self.t.new_full((len(rows), self.t.size(1)), self.spill)])

    def write(self, s: Seq, start: int = 0) -> None:
        blocks = s.table.blocks
        if start == 0:                   # a whole table (an admission, a resume): none of an older one's entries
            self._flush()
            if blocks:
                self.t[s.index, :len(blocks)] = torch.tensor(blocks, dtype=torch.long)
            self.t[s.index, len(blocks):] = self.spill
            return
        for c in range(start, len(blocks)):
            self._pending[s.index, c] = blocks[c]

    def cut(self, s: Seq) -> None:
        """s's table lost its blocks past len(blocks)."""
        self._flush()
        self.t[s.index, len(s.table.blocks):] = self.spill

    def of(self, running: list[Seq]) -> torch.Tensor:
        self._flush()
        return self.t.index_select(0, torch.tensor([s.index for s in running], dtype=torch.long))

    def _flush(self) -> None:
        if self._pending:
            at = torch.tensor(list(self._pending), dtype=torch.long)
            self.t.index_put_((at[:, 0], at[:, 1]), torch.tensor(list(self._pending.values()), dtype=torch.long))
            self._pending.clear()


class Windows:
    """PagedDecoder's windows of steps (a mixin: it reads the decoder's pool, kv, graphs, host tables, sampler)."""

    def _reserve(self, s: Seq, num_tokens: int) -> None:
        """Room in s's table for num_tokens tokens (raises NoFreeBlock, table unchanged, when the pool is dry)."""
        before = len(s.table.blocks)
        copy = self.pool.reserve(s.table, num_tokens)
        if copy is not None:                              # a shared, partly filled last block, copied on write
            self.kv.copy_block(*copy)
        self._host.write(s, before - 1 if copy is not None else before)

    def _window_size(self, rows, running: list[Seq], waiting, ahead: int = 0) -> int:
        """k steps for this window, their blocks reserved (the k - 1 tokens fed inside it and the last one, fed by
        the loop's step after it, up to the row's budget: later writes go to the spill block): sync_every (no more
        than the longest remaining budget), else the most steps whose blocks the pool holds beside one spare block
        per running row (often up to the rows' next block boundary, which needs none), else 1. While a preempted row
        waits, a window takes unused blocks only (never the cached blocks that row resumes from); else it may evict
        cached ones, as the one-step loop does a step later. ahead: tokens each row has in a window launched and not
        yet settled (a chained window starts after them)."""
        k = min(self.sync_every, max(rows[s.index].budget - s.num_response - ahead for s in running))
        if k <= 1:
            return 1
        bs, pool = self.pool.block_size, self.pool
        room = (pool.num_unused if waiting and waiting[0].preempted else pool.num_free) - len(running)
        rs = [(len(s.tokens) + ahead, s.prompt_len + rows[s.index].budget - 1, len(s.table.blocks) * bs)
              for s in running]
        cow = sum(s.table.num_tokens % bs != 0 and pool.ref[s.table.blocks[-1]] > 1 for s in running)

        def need(k: int) -> int:                  # new blocks for windows of k steps (and the copies on write)
            return cow + sum(max(0, -(-(min(t + k, lim) - have) // bs)) for t, lim, have in rs)

        if need(k) > room:
            lo, hi = 1, k                          # need(lo) fits (a window of 1 reserves nothing), need(hi) not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if need(mid) <= room else (lo, mid)
            k = lo
            if k <= 1:
                return 1
        for s, (t, lim, _) in zip(running, rs):
            self._reserve(s, min(t + k, lim))
        return k

    def _launch(self, running: list[Seq], k: int, logits: torch.Tensor, ahead: int = 0) -> Launched:
        """Queues a window of k steps of the running rows from their next token's logits [R, V] (no host sync): the
        draws, the k - 1 feeds inside it, the copy of its draws to the host and, with k > 1, the step after it.
        ahead: tokens of an earlier window not settled yet (this window's rows start after them)."""
        self.sampler.begin([s.index for s in running], [s.num_response + ahead for s in running])
        starts, slots = [len(s.tokens) + ahead for s in running], [s.slot for s in running]
        host = self._host.of(running) if k > 1 else None                                   # once a window
        tables = (host, host_to_device(host, self.device)) if k > 1 else None
        steps = []
        for j in range(k):
            steps.append(self.sampler.draw(logits, j))
            if j + 1 < k:
                logits = self._feed(steps[-1].tok, j, starts, tables, slots)
        pending = self.sampler.snapshot(steps)                     # the window's draws on their way to the host
        next_logits = self._feed(steps[-1].tok, k - 1, starts, tables, slots) if k > 1 else None
        self.stats["decode_steps"] += k
        self.stats["decode_syncs"] += 1
        return Launched(list(running), k, pending, next_logits)

    def _chain(self, rows, w: Launched, waiting, swap_point) -> Launched | None:
        """The window after w, launched before w is settled (its blocks reserved as if every row of w ran all of
        w's steps), so the device goes on while the host reads and settles w; None where the loop must see w's
        outcome first: rows wait to be admitted, weight swaps may land between windows (partial rollouts), w has no
        step after it (k = 1), or the pool cannot hold a window of two steps or more. Its rows are w's rows not
        known to have ended; a row that ends inside w runs to this window's end too, and its tokens are dropped."""
        if not self.chain_windows or w.next_logits is None or waiting or swap_point is not None:
            return None
        live = [(b, s) for b, s in enumerate(w.rows) if not s.done]
        if self._joinable(rows, len(live)):
            return None
        running = [s for _, s in live]
        k = self._window_size(rows, running, waiting, ahead=w.k)
        if k <= 1:
            return None
        logits = w.next_logits
        if len(live) != len(w.rows):
            logits = logits.index_select(0, host_to_device(torch.tensor([b for b, _ in live]), self.device))
        self.stats["chained_windows"] += 1
        return self._launch(running, k, logits, ahead=w.k)

    def _land(self, rows, w: Launched, logps, tops, stop_check) -> tuple[list[Seq], bool]:
        """Reads window w's draws (one sync) and settles its rows that had not ended before it; finishes the rows
        that ended in it and returns the others, and whether their last sampled token is fed already (by the step
        launched after the window: it runs on the device while the host settles)."""
        live = [(b, s) for b, s in enumerate(w.rows) if not s.done]
        self._settle(rows, live, *self.sampler.read(w.pending), logps, tops, stop_check)
        kept = []
        for b, s in live:
            if s.done:
                self._finish(s)
                continue
            if w.next_logits is not None:
                s.table.num_tokens += 1
                s.logits = (w.next_logits, b)
            kept.append(s)
        return kept, w.next_logits is not None

    def _feed(self, tok: torch.Tensor, j: int, starts: list[int], tables: tuple[torch.Tensor, torch.Tensor],
              slots: list[int]) -> torch.Tensor:
        """A window's step j: its tokens tok (device [R]) at positions starts[r] + j -> the next logits [R, V].
        tables: the rows' block tables on the host and on the device."""
        host, dev = tables
        if self.graphs is not None:
            if j == 0:
                return self.graphs.forward(tok, starts, dev, slots, host_tables=host)
            return self.graphs.forward(tok, None, None, slots)              # ids, positions advanced on the device
        with adapter_rows(self.adapters, slots):
            return paged_forward(self.model, self.kv, dev, [p + j for p in starts], tok[:, None],
                                 step=self.decode_step)

    def _settle(self, rows, live: list[tuple[int, Seq]], tok, lp, hit, top, logps, tops, stop_check) -> None:
        """The window's tokens into each live row (its batch index b, the row) up to its end (eos, stop string,
        budget: the row is done and lets go of the blocks past its end); each row's KV then covers all its tokens
        but the last."""
        bs = self.pool.block_size
        for b, s in live:
            r = rows[s.index]
            room = r.budget - s.num_response
            n = min(len(tok[b]), room)                                  # kept, at most, by the budget
            eos = hit[b].index(1.0, 0, n) if 1.0 in hit[b][:n] else -1
            n = eos + 1 if eos >= 0 else n
            stopped = eos >= 0
            if stop_check is not None and r.sampling.stop:              # the text, token by token (rare: slow path)
                for j in range(n - stopped):                           # an eos token ends the row without a check
                    if stop_check(s.index, s.response + tok[b][:j + 1]):
                        n, stopped = j + 1, True
                        break
            s.tokens += tok[b][:n]
            logps[s.index] += lp[b][:n]
            if top is not None and top[b] is not None:
                tops[s.index] += top[b][:n]
            if stopped or n >= room:
                s.done = True
                r.finish_reason = "stop" if stopped else "length"
            s.table.num_tokens = len(s.tokens) - 1
            keep = -(-s.table.num_tokens // bs)
            if s.done and len(s.table.blocks) > keep:
                for blk in s.table.blocks[keep:]:
                    self.pool.release(blk)
                del s.table.blocks[keep:]
                self._host.cut(s)


def batch_logits(running: list[Seq]) -> torch.Tensor:
    """The running rows' logits as one [B, V] batch: the last decode forward's tensor itself when the rows are its
    rows in order (most steps), else rows picked from each source (after admissions and ends)."""
    src0 = running[0].logits[0]
    if len(running) == src0.size(0) and all(s.logits[0] is src0 and s.logits[1] == i for i, s in enumerate(running)):
        return src0
    parts, i = [], 0
    while i < len(running):
        src, j = running[i].logits[0], i
        while j < len(running) and running[j].logits[0] is src:
            j += 1
        idx = torch.tensor([s.logits[1] for s in running[i:j]], dtype=torch.long, device=src.device)
        parts.append(src.index_select(0, idx))
        i = j
    return torch.cat(parts)
