"""CUDA-graph decoding for the rollout torch engine: a static KV cache and one captured graph per step.

`TorchEngine`'s own loop launches ~25 kernels per layer from Python for every token, so on a GPU it
is bound by launch overhead, not by the GPU. Here a whole decode step -- sample the next token from
the last logits (temperature, top_p, greedy rows), record its raw fp32 log-prob, mark rows that hit
eos or their budget, then run the model on that token against a preallocated KV cache -- is one
CUDA graph, replayed once per token with no host sync; the host looks at the `done` flags every
`sync_every` steps only.

The prefill is the engine's own (the transformers model with a DynamicCache, left padding, each
distinct prompt once); its KV is copied into the static cache. The decode forward reuses the
model's own modules (embedding, RMSNorms, projections, MLPs, rotary embedding) and only replaces
attention: the query of one token against every cache slot, slots outside [pad, current] masked.
So the log-probs are the raw model's, as in the eager loop, up to bf16 kernel-order rounding. That step, and the
static buffers it reads and writes, is graph_step.py (GraphStep, this decoder's base); here is the host side:
buckets, capture, replay, the prefill into the static cache, stop-string scans.

Graphs, and the cache they write, are keyed on (batch bucket, length bucket, sampling mode, top-logprobs
on or off); rows are padded up to the batch bucket with dummy rows that are done from the start. Every
sampling option has a graph path: a seeded row draws from its own Philox stream (the fused sampler keyed by
the row's seed, counter = step), so its tokens do not depend on the batch it decodes in; stop strings are
checked on the host at each sync (every `sync_every` steps) over the steps since the last one, and a row that
hit one is cut at the earliest such step; top-logprobs are a top-k of the raw log-softmax recorded inside the
step. Only seeded rows in a batch that needs top-p (the torch sampler, drawing from the global generator),
or without the Triton sampler, stay on the engine's eager loop (`serves`).
Weight swaps that copy into the parameters in place keep the captured graphs valid; when parameters
move (swapped by reference), the next decode captures again.

Continuous batching (`join`, decode_join.py): at each sync, rows that arrived meanwhile take
the batch rows of rows that ended; `budget` holds each row's absolute end step, so the captured step is the same.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable, NamedTuple, Sequence

import torch

from services.rollout.engine_torch import decode_join
from services.rollout.engine_torch.decode_join import Joiner, Room
from services.rollout.engine_torch.graph_step import GraphStep, State, capture, unsupported_reason
from services.rollout.engine_torch.lora import adapter_rows
from services.rollout.engine_torch.sampling import left_padded
from services.rollout.types import bucket_batch, bucket_len

log = logging.getLogger("meshrl.rollout")

# Top-logprobs recorded per step by a graph that records them (the API's maximum; rows take their first k).
TOP_K = 20
# (row, its response tokens so far, the first step not checked yet) -> whether they hold one of its stop
# strings (the engine's check; it may look only at the tail from that step back by a stop string's length).
StopCheck = Callable[[int, list, int], bool]


class Decoded(NamedTuple):
    """What a decode produced per row."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    stopped: list[bool]                                  # ended by eos or a stop string
    top: list[list[list[tuple[int, float]]]] | None      # per step, the top (id, raw log-prob) pairs


class _StopScan:
    """Host-side stop-string checks of one decode call, one window of `sync_every` steps behind the GPU: at each
    sync the window just enqueued is copied out asynchronously and the previous window is checked while the GPU
    decodes the next, so the checks cost the GPU no time (a row that hit runs at most a window longer; its
    length is cut back). A hit row is cut at the earliest step where its text holds the stop string, as the
    eager loop (which checks every step) cuts it."""

    def __init__(self, st: State, R: int, check: StopCheck):
        self.st, self.R, self.check = st, R, check
        self.tokens: list[list[int]] = [[] for _ in range(R)]      # each row's tokens so far, on the host
        self.checked = [False] * R                                  # ended, and checked to its end
        self.pending = None

    def snapshot(self, first: int, upto: int) -> None:
        st, R = self.st, self.R
        tok = st.out_tok[:R, first:upto].to("cpu", non_blocking=True)
        flags = torch.stack([st.done[:R].long(), st.length[:R]]).to("cpu", non_blocking=True)
        event = None
        if st.out_tok.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self.pending = (first, upto, tok, flags, event)

    def drain(self) -> None:
        if self.pending is None:
            return
        (first, upto, tok, flags, event), self.pending = self.pending, None
        if event is not None:
            event.synchronize()
        window, (done, lengths) = tok.tolist(), flags.tolist()
        st = self.st
        for r in range(self.R):
            toks = self.tokens[r]
            toks.extend(window[r])
            if self.checked[r]:
                continue
            end = lengths[r] if done[r] else upto
            self.checked[r] = bool(done[r])
            if end <= first or not self.check(r, toks[:end], first):
                continue
            cut = next(s for s in range(first, end) if self.check(r, toks[:s + 1], s))
            st.length[r], st.stopped[r], st.done[r] = cut + 1, True, True
            self.checked[r] = True


class GraphDecoder(GraphStep):
    """Decodes batches of rows with a captured CUDA graph per step (or the same step eagerly: use_graphs=False)."""

    def __init__(self, model, *, pad_id: int, eos_ids: Sequence[int], max_batch_size: int, use_graphs: bool = True,
                 compile: bool = True, sync_every: int = 16, max_states: int = 4, fused_sampler: bool = True,
                 triton_attention: bool = True):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"rollout.cuda_graphs: this model cannot be decoded with CUDA graphs ({reason})")
        super().__init__(model, eos_ids=eos_ids, compile=compile, fused_sampler=fused_sampler,
                         triton_attention=triton_attention)
        self.pad_id = pad_id
        self.max_batch_size = max_batch_size
        self.use_graphs = use_graphs
        self.sync_every = max(1, sync_every)
        self.max_states = max_states
        self._states: OrderedDict[tuple[int, int], State] = OrderedDict()
        self._param_ptrs = self._weights_signature()
        self._pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self.stats = {"graphs_captured": 0, "replays": 0, "joined_rows": 0}

    # ---- public

    def serves(self, seeded: Sequence[bool], temperatures: Sequence[float], top_ps: Sequence[float]) -> bool:
        """Whether the graph path decodes these rows with their sampling honoured: seeded sampled rows need the
        fused sampler, which a batch with top-p rows does not use."""
        if not any(s and t > 0 for s, t in zip(seeded, temperatures)):
            return True
        return self.fused_sampler and self._mode(temperatures, top_ps) != "top_p"

    @torch.inference_mode()
    def decode(self, prompts: Sequence[Sequence[int]], budgets: Sequence[int], temperatures: Sequence[float],
               top_ps: Sequence[float], *, seeds: Sequence[int | None] | None = None, top_logprobs: int = 0,
               stop_check: StopCheck | None = None, between_steps: Callable[[int], None] | None = None,
               join: Callable[[Room], Sequence[Joiner]] | None = None,
               ended: Callable[[dict[int, tuple]], None] | None = None,
               slots: Sequence[int] | None = None) -> Decoded:
        """Tokens, raw log-probs, ended-by-eos-or-stop flags and (top_logprobs > 0) each step's top
        (id, log-prob) pairs of each row. seeds: a row's Philox key (None: drawn); stop_check(row, tokens, since):
        whether that row's response now holds a stop string. between_steps(i): called at each sync after step i
        (partial rollouts land weight swaps there: weights copied in place, then refresh_weights()).
        join(room): at each sync, unseeded rows to add (at most room.free; room.takes and fits them); they get ids
        after the ones before, and the decode runs until no row runs and none joins. ended({id: (tokens,
        logprobs, stopped, top)}): rows as they end (with join; top then holds every recorded pair, TOP_K). Not
        with stop_check (its scans start at step 0). slots: each row's LoRA adapter slot (lora.py; None = base)."""
        slots = list(slots) if slots is not None else [0] * len(prompts)
        if self.adapters is None and any(slots):
            raise ValueError("sampling.adapter: this decoder serves no adapters")
        try:
            return self._decode(prompts, budgets, temperatures, top_ps, seeds, top_logprobs, stop_check,
                                between_steps, join, ended, slots)
        finally:
            if self.adapters is not None:
                self.adapters.rows.zero_()      # eager forwards after this one see base rows unless told

    def _decode(self, prompts, budgets, temperatures, top_ps, seeds, top_logprobs, stop_check, between_steps, join,
                ended, slots: list[int]) -> Decoded:
        R = len(prompts)
        assert 0 < R <= self.max_batch_size
        self._follow_weights()
        if stop_check is not None:
            join = None
        uniq: dict[tuple[int, tuple[int, ...]], int] = {}
        fan = [uniq.setdefault((s, tuple(q)), len(uniq)) for s, q in zip(slots, prompts)]
        L = max(len(q) for _, q in uniq)
        T = max(budgets)
        st = self._state(bucket_batch(R, self.max_batch_size), bucket_len(L + (2 * T if join else T)))
        k = min(top_logprobs, TOP_K, self.vocab_size)
        if k and st.top_ids is None:
            st.top_ids = torch.zeros((st.B, st.S, min(TOP_K, self.vocab_size)), dtype=torch.long, device=self.device)
            st.top_lp = torch.zeros(st.top_ids.shape, dtype=torch.float32, device=self.device)
        mode = (self._mode(temperatures, top_ps), bool(k))
        graph = self._graph(st, mode) if self.use_graphs else None
        self._prefill(st, list(uniq), fan, L, budgets, temperatures, top_ps, seeds)
        if self.adapters is not None:
            self.adapters.set_decode_rows(slots)          # read by the captured step, batch row by batch row
        if join is not None:
            return Decoded(*decode_join.decode(self, st, mode, graph, L, R, budgets, between_steps, join, ended))
        scan = _StopScan(st, R, stop_check) if stop_check is not None else None
        for i in range(T):
            if graph is not None:
                graph.replay()
            else:
                self._step(st, mode)
            if (i + 1) % self.sync_every == 0 or i + 1 == T:
                if scan is not None:
                    scan.drain()                                  # the last window's, while the GPU runs this one
                    scan.snapshot(i - i % self.sync_every, i + 1)
                if i + 1 < T and bool(st.done.all()):
                    break
                if between_steps is not None and i + 1 < T:
                    between_steps(i)
        if scan is not None:
            scan.drain()
        self.stats["replays"] += i + 1
        lengths, stopped = st.length[:R].tolist(), st.stopped[:R].tolist()
        tok, lp = st.out_tok[:R, :T].tolist(), st.out_lp[:R, :T].tolist()
        top = None
        if k:
            ids, vals = st.top_ids[:R, :T, :k].tolist(), st.top_lp[:R, :T, :k].tolist()
            top = [[list(zip(ids[r][t], vals[r][t])) for t in range(n)] for r, n in enumerate(lengths)]
        return Decoded([t[:n] for t, n in zip(tok, lengths)], [x[:n] for x, n in zip(lp, lengths)], stopped, top)

    def _follow_weights(self) -> None:
        """Graphs read parameters by address: the fused projections' parameters swapped by reference go back into
        their buffers (refresh_weights); any other weights swapped by reference need new graphs."""
        self.refresh_weights()
        if self.use_graphs and self._weights_signature() != self._param_ptrs:
            log.info("cuda graph decoder: parameters moved; capturing again")
            self.reset()
            self._param_ptrs = self._weights_signature()

    def _weights_signature(self) -> tuple[int, ...]:
        return tuple(p.data_ptr() for p in self.model.parameters()) + tuple(b.data_ptr() for b in self.model.buffers())

    def reset(self) -> None:
        """Drops every captured graph and its cache (the next decode captures again), and starts a new graph memory
        pool: capturing into a pool whose graphs are all gone trips the caching allocator's assert
        (`it->second->use_count > 0`, CUDACachingAllocator.cpp), seen on an H100 after the warm-up's reset."""
        self._states.clear()
        if self.use_graphs:
            self._pool = torch.cuda.graph_pool_handle()

    # ---- buckets and graphs

    def _state(self, B: int, S: int) -> State:
        key = (B, S)
        if key in self._states:
            self._states.move_to_end(key)
            return self._states[key]
        while len(self._states) >= self.max_states:
            self._states.popitem(last=False)
        st = self._states[key] = self._new_state(B, S)
        log.info("cuda graph decoder: cache bucket batch=%d len=%d (%.2f GiB KV)", B, S,
                 2 * len(st.k) * st.k[0].numel() * st.k[0].element_size() / 2**30)
        return st

    @staticmethod
    def _mode(temperatures: Sequence[float], top_ps: Sequence[float]) -> str:
        """greedy (every row), top_p (some row needs the nucleus: the torch sampler) or sample."""
        if all(t == 0 for t in temperatures):
            return "greedy"
        return "top_p" if any(p < 1 for p in top_ps) else "sample"

    def _graph(self, st: State, mode: tuple[str, bool]):
        g = st.graphs.get(mode)
        if g is not None:
            return g
        # Warm-up on a side stream (cuBLAS handles, allocator) before capture, as torch.cuda.graphs asks.
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                st.step.zero_()
                st.slot.zero_()
                self._step(st, mode)
        torch.cuda.current_stream(self.device).wait_stream(side)
        st.step.zero_()
        st.slot.zero_()
        g = torch.cuda.CUDAGraph()
        with capture(g, self._pool):
            self._step(st, mode)
        st.graphs[mode] = g
        self.stats["graphs_captured"] += 1
        log.info("cuda graph decoder: captured %s%s step for batch=%d len=%d", mode[0],
                 " + top-logprobs" if mode[1] else "", st.B, st.S)
        return g

    # ---- prefill

    def _prefill(self, st: State, uniq: list[tuple[int, tuple[int, ...]]], fan: list[int], L: int, budgets,
                 temperatures, top_ps, seeds: Sequence[int | None] | None = None) -> None:
        """The engine's prefill (left padding, one forward per distinct (adapter slot, prompt)), copied into the
        static cache."""
        from transformers import DynamicCache

        dev, R = self.device, len(fan)
        prompts = [q for _, q in uniq]
        lens = [len(q) for q in prompts]
        ids, mask, pos = left_padded(prompts, self.pad_id, L)
        cache = DynamicCache(config=self.model.config)
        with adapter_rows(self.adapters, [s for s, _ in uniq]):
            out = self.model(input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev),
                             past_key_values=cache, use_cache=True, logits_to_keep=1)
        fan_t = torch.tensor(fan, dtype=torch.long, device=dev)
        st.logits[:R].copy_(out.logits[:, -1, :].index_select(0, fan_t))
        st.logits[R:].zero_()
        for layer, (k, v) in enumerate(zip(st.k, st.v)):
            k[:R, :, :L].copy_(cache.layers[layer].keys.index_select(0, fan_t))
            v[:R, :, :L].copy_(cache.layers[layer].values.index_select(0, fan_t))
        row_len = torch.tensor([lens[f] for f in fan] + [0] * (st.B - R), dtype=torch.long)
        st.pos.copy_(row_len)
        st.pad.copy_(torch.where(torch.arange(st.B) < R, L - row_len, L))   # dummy rows see only their own slot
        st.slot.fill_(L)
        st.step.zero_()
        # Unseeded rows: consecutive keys from a fresh draw; seeded rows: their own (63-bit) seed.
        base = int(torch.randint(0, 2**62, (1,)).item())
        keys = [base + r if seeds is None or seeds[r] is None else int(seeds[r]) for r in range(R)]
        st.seed.copy_(torch.tensor(keys + [base + r for r in range(R, st.B)], dtype=torch.long))
        pad_rows = st.B - R
        st.budget.copy_(torch.tensor(list(budgets) + [1] * pad_rows, dtype=torch.long))
        st.temperature.copy_(torch.tensor(list(temperatures) + [0.0] * pad_rows, dtype=torch.float32))
        st.top_p.copy_(torch.tensor(list(top_ps) + [1.0] * pad_rows, dtype=torch.float32))
        st.length.zero_()
        st.stopped.zero_()
        st.done.copy_(torch.arange(st.B) >= R)
