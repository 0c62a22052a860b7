"""The paged decode of the torch engine: rows admitted while the KV budget has room, a GRPO group's prompt prefilled
once and its samples forked from it, prefixes found in the prefix cache reused, rows preempted when the pool runs
dry and resumed later (their history re-fed, mostly from the cache), and each finished row's blocks cached for the
next call; an episode's turn (a row with an episode id) keeps its whole table pinned for the episode's next turn
(pins.py), which then feeds only its new tokens.

LoRA adapters (lora.py): each row carries its adapter's slot, and every forward (prefill, eager or graph decode step)
sets the bank's rows to the slots of the rows it feeds, in order. What a row's KV depends on, its key, is the base
weights (an epoch, bumped at each swap) and its adapter's identity (name, version, load; None for the base model):
the prefix cache, forks and pins match on the key as well as the tokens, and a reloaded or unloaded adapter's blocks
and pins go (adapters_changed) while the base's and the other adapters' stay.

Steps run in windows of up to `sync_every` with one host sync each (window.py); each step samples on the device
(sample.py): the fused Triton sampler on CUDA where it applies (each row's Philox stream, keyed by its seed, counter =
its token index: a seeded row samples the non-paged CUDA decoder's tokens), else the eager loop's sampler
(sampling.sample_tokens with each row's generator, one draw per token: a seeded row samples the eager loop's tokens).
Each token's log-prob is the raw model's log-softmax.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Callable, Sequence

import torch

from services.rollout.engine_torch.decode_join import Room
from services.rollout.engine_torch.lora import adapter_rows, bank_of
from services.rollout.engine_torch.paged import attention, metrics
from services.rollout.engine_torch.paged.blocks import BlockPool, BlockTable, NoFreeBlock
from services.rollout.engine_torch.paged.forward import DecodeStep, paged_forward
from services.rollout.engine_torch.paged.kv import PagedKV, num_blocks_for
from services.rollout.engine_torch.paged.pins import EpisodePins
from services.rollout.engine_torch.paged.sample import StepSampler, fused_applies
from services.rollout.engine_torch.paged.window import SYNC_EVERY, HostTables, Seq, Windows, batch_logits

log = logging.getLogger("meshrl.rollout")

# Tokens fed per prefill forward (rows are grouped up to it; one longer row goes alone).
PREFILL_TOKENS = 16384
# (row index, its response tokens so far) -> whether they now hold one of its stop strings.
StopCheck = Callable[[int, list], bool]
# A joining row's prompt and budget always fit (continuous batching's Room: the pool admits or preempts).
_ANY = 2**62


def _fill(r, s: Seq, lp: list[float], top: list) -> None:
    """A row's outputs into its engine row."""
    r.tokens, r.logprobs = s.response, lp
    r.top = top if r.sampling.top_logprobs else None
    r.cached = max(s.cached_prompt, 0)


class PagedDecoder(Windows):
    """Decodes rows over a paged KV cache shared by every call (the prefix cache lives across calls)."""

    def __init__(self, model, *, block_size: int, budget_gib: float | None, max_model_len: int, max_batch_size: int,
                 cuda_graphs: bool = False, fused_sampler: bool = True, sync_every: int | None = None,
                 compile: bool = False, max_tokens: int = 1):
        cfg = model.config
        p = next(model.parameters())
        attn = model.model.layers[0].self_attn
        num_blocks, why = num_blocks_for(model, block_size=block_size, budget_gib=budget_gib,
                                         max_model_len=max_model_len, max_batch_size=max_batch_size,
                                         max_tokens=max_tokens)
        self.model, self.device = model, p.device
        self.adapters = bank_of(model)                   # LoRA adapters served on the model (None: none)
        assert self.adapters is None or self.adapters.rows.numel() >= max_batch_size
        # The base weights' epoch (the KV tag of every block; bumped at each swap) and the engine's weight version
        # this cache has accounted for (an adapter load moves that version, not the epoch).
        self._epoch, self._version = 0, 0
        self.pool = BlockPool(num_blocks, block_size)
        # One block past the pool's, never handed out: a window's writes past a row's reserved blocks land there
        # (window.py; every host table entry past a row's blocks names it).
        self.kv = PagedKV(num_layers=cfg.num_hidden_layers, num_kv=cfg.num_key_value_heads, head_dim=attn.head_dim,
                          num_blocks=num_blocks + 1, block_size=block_size, dtype=p.dtype, device=p.device)
        self.spill = num_blocks
        self.max_batch_size = max_batch_size
        self.fused_sampler, self.sync_every = fused_sampler, max(1, SYNC_EVERY if sync_every is None else sync_every)
        # Launch each window before the one before it is settled, where the loop needs nothing from it (window.py).
        self.chain_windows = True
        self.stats = {"preemptions": 0, "resumed_rows": 0, "swap_recomputed_rows": 0, "prefill_tokens": 0,
                      "prefill_tokens_saved": 0, "max_running_rows": 0, "decode_steps": 0, "decode_syncs": 0,
                      "chained_windows": 0}
        # The decode step with the Triton kernel (forward.DecodeStep: the graph decoder's fused, grouped, compiled
        # layers), eager or captured; None where the kernel cannot run (the eager paged forward attends then).
        self.decode_step = None
        if attention.graphs_reason(self.device, block_size, attn.head_dim) is None:
            self.decode_step = DecodeStep(model, self.kv, kernel=True, compile=compile)
        self.graphs = self._graphs(max_model_len) if cuda_graphs else None
        self.pins = EpisodePins(self.pool)
        # Held by decode(); episodes that end while a decode runs queue here and are let go at its next step.
        self._busy = threading.RLock()
        self._joins = None                               # the running decode's continuous.Joining, if any
        self._ending: deque[str] = deque()
        metrics.watch(self)
        log.info("rollout paged KV: %d blocks of %d tokens, %.2f GiB (%s)", num_blocks, block_size,
                 self.kv.num_bytes / 2**30, why)

    def _graphs(self, max_model_len: int):
        """The CUDA-graph decode forward (graphs.py) over one scratch block held for good by its dummy rows."""
        from services.rollout.engine_torch.paged.graphs import PagedGraphs

        hd, bs = self.kv.k[0].size(-1), self.pool.block_size
        why = attention.graphs_reason(self.device, bs, hd)
        if why is not None:
            raise ValueError(f"rollout.kv_cache_cuda_graphs: true cannot work here ({why}); set it to false")
        # Wide enough for two windows' tokens past the longest row (window.py).
        return PagedGraphs(self.model, self.kv, width=-(-(max_model_len + 2 * self.sync_every) // bs),
                           scratch_block=self.pool.allocate(), max_batch_size=self.max_batch_size,
                           step=self.decode_step)

    def metrics(self) -> dict:
        return {**self.pool.metrics(), **self.stats, **self.pins.metrics()}

    def end_episode(self, episode: str) -> None:
        """Lets go of an episode's pinned blocks (any thread): now, or at the running decode's next step."""
        self._ending.append(episode)
        if self._busy.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._busy.release()

    def set_version(self, version: int) -> None:
        """The base weights were swapped (now `version`): every cached block and pin of the old ones goes (KV is never
        reused across weights)."""
        with self._busy:
            self.refresh_weights()
            self._version, self._epoch = version, self._epoch + 1
            self.pool.set_version(self._epoch)
            self.pins.set_version(self._epoch)

    def refresh_weights(self) -> None:
        """Fused parameters swapped by reference go back into the decode step's buffers (fused_weights.py)."""
        if self.decode_step is not None:
            self.decode_step.refresh_weights()

    def adapters_changed(self, version: int) -> None:
        """An adapter was loaded, reloaded or unloaded (the engine's weight version is now `version`; the base weights
        are not swapped): cached blocks and pins of an adapter load no longer served go, the rest stay."""
        with self._busy:
            self._version = version
            served = self.adapters.identities() if self.adapters is not None else set()
            self.pool.keep_adapters(served)
            self.pins.keep_adapters(served)

    def _key(self, slot: int) -> tuple:
        """What the KV of a row of adapter `slot` is computed with now: (base epoch, adapter identity or None)."""
        return self._epoch, (self.adapters.identity(slot) if self.adapters is not None else None)

    def _drain(self) -> None:
        while self._ending:
            self.pins.release(self._ending.popleft())

    @torch.inference_mode()
    def decode(self, rows, version: int, *, eos_ids: Sequence[int], stop_check: StopCheck | None = None,
               swap_point: Callable[[], int] | None = None, pause: bool = False, joins=None) -> None:
        """Decodes engine rows (decode.Row: prompt, budget, sampling, generator, adapter slot) to their end, filling
        their tokens, log-probs, top-logprobs and finish reasons. version: the engine's weight version (one this
        cache was not told of by set_version or adapters_changed counts as new weights: cached blocks go).
        swap_point (partial rollouts): lands posted weight swaps between two steps and returns the version; after a
        swap the rows go on over their old KV, or (pause) have it recomputed by the new weights.
        joins (continuous batching; continuous.Joining): between windows, rows of pending requests join `rows` (appended
        to the list) while the batch has room, and each row is handed to joins.rows_ended as soon as it ended."""
        with self._busy:
            self._joins = joins
            try:
                self._decode(rows, version, eos_ids, stop_check, swap_point, pause)
            finally:
                self._joins = None
                if self.graphs is not None and self.adapters is not None:
                    self.adapters.rows.zero_()      # forwards after this one read base rows unless told
        if self._ending:                                 # ended while this ran, after its last step
            self.end_episode(self._ending.popleft())

    def _decode(self, rows, version: int, eos_ids: Sequence[int], stop_check: StopCheck | None,
                swap_point: Callable[[], int] | None, pause: bool) -> None:
        if version != self._version:      # a version set without a swap (the HTTP API's update_weight_version)
            self.set_version(version)
        self.refresh_weights()
        self.eos = torch.tensor(sorted(eos_ids) or [-1], dtype=torch.long, device=self.device)
        seqs = [Seq(i, list(r.prompt), len(r.prompt), episode=r.episode, slot=r.slot) for i, r in enumerate(rows)]
        self.sampler = StepSampler(rows, self.device, self.eos, fused=fused_applies(rows, self.device,
                                                                                    self.fused_sampler))
        self._host = HostTables(rows, self.pool.block_size, self.sync_every, self.spill)
        waiting, running = deque(seqs), []
        tops: list[list] = [[] for _ in rows]
        logps: list[list[float]] = [[] for _ in rows]
        flight = None                                    # a window launched and not settled (window.py)
        try:
            while waiting or running:
                self._drain()
                if flight is None:
                    running += self._admit(waiting, len(running))
                    self._check_room(running, waiting)
                    if not running:                        # the pins let go of what one row needs
                        continue
                    self.stats["max_running_rows"] = max(self.stats["max_running_rows"], len(running))
                    k = self._window_size(rows, running, waiting)
                    flight = self._launch(running, k, batch_logits(running))
                after = self._chain(rows, flight, waiting, swap_point)
                running, fed = self._land(rows, flight, logps, tops, stop_check)
                if self._joins is not None:
                    self._answer(rows, flight.rows, logps, tops)
                    if after is None:                # pending rows join before the loop looks for work
                        self._join(rows, seqs, logps, tops, waiting, len(running))
                flight = after
                if flight is not None:
                    continue
                if not fed:
                    running = self._grow(running, waiting)
                now = swap_point() if swap_point is not None else version
                if now != version:
                    if fed:          # the step ran ahead with the old weights: the new ones feed that token again
                        for s in running:
                            s.table.num_tokens -= 1
                        fed = False
                    running, version = self._swapped(rows, seqs, running, waiting, now, pause)
                if running and not fed:
                    logits = self._step(running)
                    for i, s in enumerate(running):
                        s.table.num_tokens += 1
                        s.logits = (logits, i)
        finally:
            for s in seqs:                      # an error mid-decode frees what its rows held
                if s.table.blocks:
                    self.pool.free(s.table)
        for r, s, lp, top in zip(rows, seqs, logps, tops):
            _fill(r, s, lp, top)

    # ---- continuous batching (rollout.continuous_batching)

    def _room(self, rows, busy: int) -> Room:
        """What this call can take now: batch rows not running or waiting, and rows its sampler mode serves (any
        prompt and budget: the pool admits, and preempts, as for its own rows)."""
        fused = self.sampler.fused
        mode = ("sample" if all(r.sampling.top_p >= 1 for r in rows) else "greedy") if fused else "top_p"
        return Room(free=self.max_batch_size - busy, step=0, slot=_ANY, size=2 * _ANY, sampler=mode,
                    top_logprobs=not fused)

    def _joinable(self, rows, busy: int) -> bool:
        """Whether pending rows could join once the windows launched are settled (a chained window is not
        launched then)."""
        if self._joins is None:
            return False
        room = self._room(rows, busy)
        return room.free > 0 and self._joins.waiting(room)

    def _join(self, rows, seqs: list[Seq], logps, tops, waiting: deque, num_running: int) -> None:
        """Rows of pending requests join the call while the batch has room: they wait to be admitted as its own."""
        room = self._room(rows, num_running + len(waiting))
        new = self._joins.take(room) if room.free > 0 else []
        if not new:
            return
        first = len(rows)
        rows += new
        self.sampler.extend(new)
        self._host.add(new)
        for i, r in enumerate(new, first):
            s = Seq(i, list(r.prompt), len(r.prompt), episode=r.episode, slot=r.slot)
            seqs.append(s)
            waiting.append(s)
            logps.append([])
            tops.append([])

    def _answer(self, rows, landed: list[Seq], logps, tops) -> None:
        """The rows that ended in the window just landed, filled in and handed over (their requests answered)."""
        done = [s for s in landed if s.done and not s.answered]
        for s in done:
            s.answered = True
            _fill(rows[s.index], s, logps[s.index], tops[s.index])
        if done:
            self._joins.rows_ended([rows[s.index] for s in done])

    def _check_room(self, running: list[Seq], waiting: deque) -> None:
        """After admission: no row runs while one waits only when the pool cannot hold one row, even with the
        episodes' pins let go (one is evicted here per call; the loop looks again)."""
        if running or self.pins.evict_one():
            return
        raise ValueError("rollout.kv_cache_gib: the paged KV cache cannot hold one row's prompt "
                         f"({len(waiting[0].tokens)} tokens in {self.pool.num_blocks} blocks of "
                         f"{self.pool.block_size}); raise it")

    def _step(self, running: list[Seq]) -> torch.Tensor:
        """The running rows' last tokens through the model (a graph replay with kv_cache_cuda_graphs)."""
        tables, starts = self._host.of(running), [s.table.num_tokens for s in running]
        slots = [s.slot for s in running]
        if self.graphs is not None:
            return self.graphs.forward([s.tokens[-1] for s in running], starts, tables, slots)
        with adapter_rows(self.adapters, slots):
            return paged_forward(self.model, self.kv, tables, starts, [s.tokens[-1:] for s in running],
                                 step=self.decode_step)

    # ---- admission and prefill

    def _admit(self, waiting: deque, num_running: int) -> list[Seq]:
        """Takes waiting rows (in order) while the batch and the pool have room, prefills them: each distinct
        (key, sequence) once, from the end of its cached prefix; its copies (same tokens, same adapter) fork its
        blocks."""
        leaders: dict[tuple, Seq] = {}
        followers: list[tuple[Seq, Seq]] = []
        admitted: list[Seq] = []
        # Free blocks per running row stay in reserve, so admitting does not preempt at the next step: one, and with
        # windows one more (a window's blocks beside that spare, window.py).
        per_row = 2 if self.sync_every > 1 else 1
        reserve = num_running * per_row
        while waiting and num_running + len(admitted) < self.max_batch_size:
            s = waiting[0]
            s.key = self._key(s.slot)
            epoch, adapter = s.key
            key = (s.key, tuple(s.tokens))
            if key in leaders:
                followers.append((s, leaders[key]))
            else:
                # At least the last token is fed (its logits are the next token's distribution). A row that does
                # not fit yet gives its cache hits back and is not counted (it looks again next step).
                # An episode's turn starts from its pinned table (partial last block included), else the cache.
                counted = dict(self.pool.stats)
                pin = self.pins.take(s.episode, s.tokens, epoch, adapter) if s.episode else None
                cached = pin.table if pin else self.pool.lookup(s.tokens, epoch, limit=len(s.tokens) - 1,
                                                                adapter=adapter)
                need = -(-len(s.tokens) // self.pool.block_size) - len(cached.blocks)
                if need + reserve + 1 > self.pool.num_free:
                    if pin:
                        self.pins.give_back(s.episode, pin)
                    else:
                        self.pool.free(cached)
                        self.pool.stats.update(counted)
                    break
                s.table = cached
                copy = self.pool.reserve(s.table, len(s.tokens))
                if copy is not None:                    # a pinned partial block another row shares
                    self.kv.copy_block(*copy)
                if s.cached_prompt < 0:
                    s.cached_prompt = cached.num_tokens
                leaders[key] = s
            reserve += per_row
            if s.preempted:
                s.preempted = False
                self.stats["resumed_rows"] += 1
            admitted.append(waiting.popleft())
        self._prefill(list(leaders.values()))
        for s in admitted:
            self._host.write(s)
        for s, lead in followers:
            s.table, s.logits = self.pool.fork(lead.table), lead.logits
            self._host.write(s)
            if s.cached_prompt < 0:
                s.cached_prompt = s.prompt_len
            self.stats["prefill_tokens_saved"] += len(s.tokens)
        return admitted

    def _prefill(self, seqs: list[Seq]) -> None:
        """Feeds each sequence's tokens past its cached prefix (groups of up to PREFILL_TOKENS), then caches its
        full blocks."""
        i = 0
        while i < len(seqs):
            group, total = [], 0
            while i < len(seqs) and (not group or total + len(seqs[i].tokens) <= PREFILL_TOKENS):
                group.append(seqs[i])
                total += len(seqs[i].tokens) - seqs[i].table.num_tokens
                i += 1
            with adapter_rows(self.adapters, [s.slot for s in group]):
                logits = paged_forward(self.model, self.kv, [s.table.blocks for s in group],
                                       [s.table.num_tokens for s in group],
                                       [s.tokens[s.table.num_tokens:] for s in group])
            for row, s in enumerate(group):
                self.stats["prefill_tokens_saved"] += s.table.num_tokens
                self.stats["prefill_tokens"] += len(s.tokens) - s.table.num_tokens
                s.table.num_tokens = len(s.tokens)
                s.logits = (logits, row)
                self._register(s)

    # ---- one decode step

    def _register(self, s: Seq) -> bool:
        """Caches s's full blocks under its key, unless its KV is of weights no longer served (a partial rollout's
        row over an older version's KV, or an adapter reloaded meanwhile); whether it did."""
        if s.key != self._key(s.slot):
            return False
        epoch, adapter = s.key
        self.pool.register(s.tokens, s.table, epoch, adapter=adapter)
        return True

    def _finish(self, s: Seq) -> None:
        """A row ended: its full blocks stay cached, then it lets go; an episode's turn pins its whole table for the
        episode's next turn instead (pins.py)."""
        if self._register(s) and s.episode:
            self.pins.pin(s.episode, s.table, s.tokens, *s.key)
            s.table = BlockTable()
        else:
            self.pool.free(s.table)

    def _grow(self, running: list[Seq], waiting: deque) -> list[Seq]:
        """Room for each running row's next token; when the pool is dry, the latest admitted rows are preempted
        (their blocks cached, then let go) and wait to resume. Returns the rows still running."""
        kept = list(running)
        i = 0
        while i < len(kept):
            s = kept[i]
            try:
                self._reserve(s, s.table.num_tokens + 1)
            except NoFreeBlock:
                if len(kept) == 1 and self.pins.evict_one():     # running rows first: unpin before the last goes
                    continue
                victim = kept.pop()
                if victim is s and not kept:
                    raise ValueError("rollout.kv_cache_gib: the paged KV cache cannot hold one row "
                                     f"({len(s.tokens)} tokens in {self.pool.num_blocks} blocks); raise it")
                self._preempt(victim, waiting)
                continue
            i += 1
        return kept

    def _preempt(self, s: Seq, waiting: deque, *, count: bool = True) -> None:
        self._register(s)
        self.pool.free(s.table)
        s.logits = None
        s.preempted = True
        waiting.appendleft(s)
        self.stats["preemptions" if count else "swap_recomputed_rows"] += 1

    def _swapped(self, rows, seqs: list[Seq], running: list[Seq], waiting: deque, version: int, pause: bool):
        """Partial rollouts: a weight swap landed between two steps (the engine's swap already dropped the cache's
        and the pins' older blocks). Each unfinished row's tokens from the next one on are the new version's; with
        pause the running rows let go of their KV and resume at once, prefilled by the new weights (as a preempted
        row), while continue rows keep the old weights' KV (never cached or pinned as the new version's: their
        blocks keep their admission's key). An adapter (re)loaded mid-decode moves the version as well (its rows
        tagged as on today's loop); its rows' KV is then of the old load, the others' still current. Returns the rows
        still running and the version."""
        for r, s in zip(rows, seqs):
            if not s.done:
                r.swaps.append((len(s.response), version))
        if not pause:
            return running, version
        for s in reversed(running):
            self._preempt(s, waiting, count=False)
        return [], version

