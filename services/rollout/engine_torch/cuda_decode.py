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
So the log-probs are the raw model's, as in the eager loop, up to bf16 kernel-order rounding.

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
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import torch

from services.rollout.engine_torch import decode_attention, decode_join, fused_sample
from services.rollout.engine_torch.decode_join import Joiner, Room
from services.rollout.engine_torch.sampling import left_padded, top_p_filter
from services.rollout.types import bucket_batch, bucket_len

log = logging.getLogger("meshrl.rollout")

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")
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


def unsupported_reason(model) -> str | None:
    """Why this model cannot use the graph decoder (None when it can)."""
    cfg = model.config
    if getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return f"model type {getattr(cfg, 'model_type', None)!r} (have {', '.join(SUPPORTED_MODEL_TYPES)})"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ["full_attention"])):
        return "sliding-window layers"
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope != "default":
        return f"rope type {rope!r} (only 'default' is static)"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        return "no model.layers / lm_head"
    attn = inner.layers[0].self_attn
    if hasattr(attn, "q_norm") or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return "attention with q/k norms or fused projections"
    return None


@dataclass
class _State:
    """Static buffers of one (batch, length) bucket; every captured graph of it reads and writes these."""

    B: int
    S: int
    k: list[torch.Tensor]                 # per layer [B, kv_heads, S, head_dim]
    v: list[torch.Tensor]
    logits: torch.Tensor                  # [B, V] model dtype: the logits the next step samples from
    pos: torch.Tensor                     # [B] rope position of the token being fed
    slot: torch.Tensor                    # [1] cache slot of the token being fed (same for every row)
    step: torch.Tensor                    # [1] index of the token being sampled
    pad: torch.Tensor                     # [B] first valid cache slot (left padding)
    budget: torch.Tensor                  # [B] the step a row ends at, at the latest (start + its budget)
    temperature: torch.Tensor             # [B]
    top_p: torch.Tensor                   # [B]
    out_tok: torch.Tensor                 # [B, S]
    out_lp: torch.Tensor                  # [B, S] fp32 raw log-probs
    length: torch.Tensor                  # [B] the step after its last token, when done (start + tokens)
    stopped: torch.Tensor                 # [B] ended by eos
    done: torch.Tensor                    # [B]
    slots: torch.Tensor                   # [S] arange
    seed: torch.Tensor                    # [B] Philox key of each row (its seed, or drawn per decode call)
    tok: torch.Tensor                     # [B] the token sampled this step
    lp: torch.Tensor                      # [B] fp32 its raw log-prob
    sample_scratch: tuple                 # the fused sampler's per-chunk partials
    graphs: dict = field(default_factory=dict)
    top_ids: torch.Tensor | None = None   # [B, S, TOP_K] top-logprob ids, allocated when first asked for
    top_lp: torch.Tensor | None = None    # [B, S, TOP_K] their raw log-probs


class _StopScan:
    """Host-side stop-string checks of one decode call, one window of `sync_every` steps behind the GPU: at each
    sync the window just enqueued is copied out asynchronously and the previous window is checked while the GPU
    decodes the next, so the checks cost the GPU no time (a row that hit runs at most a window longer; its
    length is cut back). A hit row is cut at the earliest step where its text holds the stop string, as the
    eager loop (which checks every step) cuts it."""

    def __init__(self, st: _State, R: int, check: StopCheck):
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


class GraphDecoder:
    """Decodes batches of rows with a captured CUDA graph per step (or the same step eagerly: use_graphs=False)."""

    def __init__(self, model, *, pad_id: int, eos_ids: Sequence[int], max_batch_size: int, use_graphs: bool = True,
                 compile: bool = True, sync_every: int = 16, max_states: int = 4, fused_sampler: bool = True,
                 triton_attention: bool = True):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"rollout.cuda_graphs: this model cannot be decoded with CUDA graphs ({reason})")
        self.model = model
        self.pad_id = pad_id
        self.max_batch_size = max_batch_size
        self.use_graphs = use_graphs
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.fused_sampler = fused_sampler and fused_sample.available(self.device)
        self.sync_every = max(1, sync_every)
        self.max_states = max_states
        cfg = model.config
        attn = model.model.layers[0].self_attn
        self.num_heads = cfg.num_attention_heads
        self.num_kv = cfg.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        hd = self.head_dim
        self.triton_attention = (triton_attention and decode_attention.available(self.device) and hd >= 16
                                 and hd & (hd - 1) == 0)
        self.vocab_size = int(cfg.vocab_size)
        # The model module's own rotary helper (Llama and Qwen2 share the formula).
        self._apply_rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        self._eos = torch.tensor(sorted(eos_ids) or [-1], dtype=torch.long, device=self.device)
        self._states: OrderedDict[tuple[int, int], _State] = OrderedDict()
        self._param_ptrs = self._weights_signature()
        self._pool = torch.cuda.graph_pool_handle() if use_graphs else None
        # torch.compile fuses the ~40 small kernels of each layer (norms, rope, softmax, SiLU, casts) into a few;
        # in a graph every launch still costs a few microseconds, and at decode sizes launches are the time.
        # One layer is compiled and reused by all (regional compilation: seconds, not minutes); default mode,
        # no inductor cudagraphs: _graph below captures the whole step. After the first change of bucket the
        # sizes are compiled dynamic.
        self._layer_fn = torch.compile(self._layer, fullgraph=True) if compile else self._layer
        # q, k and v projections as one GEMM per layer (three small ones were ~10% of a step at batch 512):
        # concatenated copies of the weights, refreshed from the model at every decode call (~50 MB at 0.5B),
        # so weight updates of any kind are seen. Only where all three have a bias or none has.
        self._qkv = self._qkv_buffers()
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
               ended: Callable[[dict[int, tuple]], None] | None = None) -> Decoded:
        """Tokens, raw log-probs, ended-by-eos-or-stop flags and (top_logprobs > 0) each step's top
        (id, log-prob) pairs of each row. seeds: a row's Philox key (None: drawn); stop_check(row, tokens, since):
        whether that row's response now holds a stop string. between_steps(i): called at each sync after step i
        (partial rollouts land weight swaps there: weights copied in place, then refresh_weights()).
        join(room): at each sync, unseeded rows to add (at most room.free; room.takes and fits them); they get ids
        after the ones before, and the decode runs until no row runs and none joins. ended({id: (tokens,
        logprobs, stopped, top)}): rows as they end (with join; top then holds every recorded pair, TOP_K). Not
        with stop_check (its scans start at step 0)."""
        R = len(prompts)
        assert 0 < R <= self.max_batch_size
        self._follow_weights()
        if stop_check is not None:
            join = None
        uniq: dict[tuple[int, ...], int] = {}
        fan = [uniq.setdefault(tuple(q), len(uniq)) for q in prompts]
        L = max(len(q) for q in uniq)
        T = max(budgets)
        st = self._state(bucket_batch(R, self.max_batch_size), bucket_len(L + (2 * T if join else T)))
        k = min(top_logprobs, TOP_K, self.vocab_size)
        if k and st.top_ids is None:
            st.top_ids = torch.zeros((st.B, st.S, min(TOP_K, self.vocab_size)), dtype=torch.long, device=self.device)
            st.top_lp = torch.zeros(st.top_ids.shape, dtype=torch.float32, device=self.device)
        mode = (self._mode(temperatures, top_ps), bool(k))
        graph = self._graph(st, mode) if self.use_graphs else None
        self._prefill(st, list(uniq), fan, L, budgets, temperatures, top_ps, seeds)
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
        """Graphs read parameters by address: weights swapped by reference (not copied in place) need new ones;
        the fused q/k/v copies are refreshed at every decode call."""
        if self.use_graphs and self._weights_signature() != self._param_ptrs:
            log.info("cuda graph decoder: parameters moved; capturing again")
            self.reset()
            self._param_ptrs = self._weights_signature()
        self._refresh_qkv()

    def _qkv_buffers(self) -> list[tuple[torch.Tensor, torch.Tensor | None]] | None:
        attn = [layer.self_attn for layer in self.model.model.layers]
        has_bias = {p.bias is not None for a in attn for p in (a.q_proj, a.k_proj, a.v_proj)}
        if len(has_bias) != 1:
            return None
        out = []
        for a in attn:
            w = torch.empty((sum(p.weight.shape[0] for p in (a.q_proj, a.k_proj, a.v_proj)), a.q_proj.weight.shape[1]),
                            dtype=a.q_proj.weight.dtype, device=a.q_proj.weight.device)
            b = torch.empty(w.shape[0], dtype=w.dtype, device=w.device) if a.q_proj.bias is not None else None
            out.append((w, b))
        return out

    def refresh_weights(self) -> None:
        """After weights were copied into the model in place (a swap): the fused q/k/v copies follow."""
        self._refresh_qkv()

    @torch.no_grad()
    def _refresh_qkv(self) -> None:
        if self._qkv is None:
            return
        for layer, (w, b) in zip(self.model.model.layers, self._qkv):
            a = layer.self_attn
            torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], out=w)
            if b is not None:
                torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias], out=b)

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

    def _state(self, B: int, S: int) -> _State:
        key = (B, S)
        if key in self._states:
            self._states.move_to_end(key)
            return self._states[key]
        while len(self._states) >= self.max_states:
            self._states.popitem(last=False)
        d, kw = self.device, dict(device=self.device)
        n_layers = len(self.model.model.layers)
        shape = (B, self.num_kv, S, self.head_dim)
        st = _State(
            B=B, S=S,
            k=[torch.zeros(shape, dtype=self.dtype, device=d) for _ in range(n_layers)],
            v=[torch.zeros(shape, dtype=self.dtype, device=d) for _ in range(n_layers)],
            logits=torch.zeros((B, self.vocab_size), dtype=self.dtype, **kw),
            pos=torch.zeros(B, dtype=torch.long, **kw), slot=torch.zeros(1, dtype=torch.long, **kw),
            step=torch.zeros(1, dtype=torch.long, **kw), pad=torch.zeros(B, dtype=torch.long, **kw),
            budget=torch.ones(B, dtype=torch.long, **kw), temperature=torch.ones(B, dtype=torch.float32, **kw),
            top_p=torch.ones(B, dtype=torch.float32, **kw), out_tok=torch.zeros((B, S), dtype=torch.long, **kw),
            out_lp=torch.zeros((B, S), dtype=torch.float32, **kw), length=torch.zeros(B, dtype=torch.long, **kw),
            stopped=torch.zeros(B, dtype=torch.bool, **kw), done=torch.zeros(B, dtype=torch.bool, **kw),
            slots=torch.arange(S, **kw), seed=torch.zeros(B, dtype=torch.long, **kw),
            tok=torch.zeros(B, dtype=torch.long, **kw), lp=torch.zeros(B, dtype=torch.float32, **kw),
            sample_scratch=fused_sample.make_scratch(B, d) if self.fused_sampler else ())
        self._states[key] = st
        log.info("cuda graph decoder: cache bucket batch=%d len=%d (%.2f GiB KV)", B, S,
                 2 * n_layers * st.k[0].numel() * st.k[0].element_size() / 2**30)
        return st

    @staticmethod
    def _mode(temperatures: Sequence[float], top_ps: Sequence[float]) -> str:
        """greedy (every row), top_p (some row needs the nucleus: the torch sampler) or sample."""
        if all(t == 0 for t in temperatures):
            return "greedy"
        return "top_p" if any(p < 1 for p in top_ps) else "sample"

    def _graph(self, st: _State, mode: tuple[str, bool]):
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
        with torch.cuda.graph(g, pool=self._pool):
            self._step(st, mode)
        st.graphs[mode] = g
        self.stats["graphs_captured"] += 1
        log.info("cuda graph decoder: captured %s%s step for batch=%d len=%d", mode[0],
                 " + top-logprobs" if mode[1] else "", st.B, st.S)
        return g

    # ---- prefill and one step

    def _prefill(self, st: _State, prompts: list[tuple[int, ...]], fan: list[int], L: int, budgets, temperatures,
                 top_ps, seeds: Sequence[int | None] | None = None) -> None:
        """The engine's prefill (left padding, one forward per distinct prompt), copied into the static cache."""
        from transformers import DynamicCache

        dev, R = self.device, len(fan)
        lens = [len(q) for q in prompts]
        ids, mask, pos = left_padded(prompts, self.pad_id, L)
        cache = DynamicCache(config=self.model.config)
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

    def _step(self, st: _State, mode: tuple[str, bool]) -> None:
        """Samples token `step` from st.logits, records it, then feeds it through the model (graph-safe: no syncs).
        mode: (sampler mode, record top-logprobs)."""
        sampler, with_top = mode
        if self.fused_sampler and sampler != "top_p":
            fused_sample.sample(st.logits, st.temperature, st.seed, st.step, st.tok, st.lp, st.sample_scratch)
            tok, lp = st.tok, st.lp
        else:
            tok, lp = self._torch_sample(st, sampler)
        if with_top:
            # The top-k of the log-softmax is the top-k of the logits, less the log-sum-exp, which the sampled
            # token's raw log-prob gives back (lse = z_tok - lp): one pass over the logits, in their own dtype.
            top_z, top_i = st.logits.topk(st.top_ids.size(-1), dim=-1)
            lse = st.logits.gather(1, tok.unsqueeze(-1)).float() - lp.unsqueeze(-1)            # [B, 1]
            st.top_ids.index_copy_(1, st.step, top_i.unsqueeze(1))
            st.top_lp.index_copy_(1, st.step, (top_z.float() - lse).unsqueeze(1))
        st.out_tok.index_copy_(1, st.step, tok.unsqueeze(-1))
        st.out_lp.index_copy_(1, st.step, lp.unsqueeze(-1))
        hit = (tok.unsqueeze(-1) == self._eos).any(-1)
        newly = ~st.done & (hit | (st.step + 1 >= st.budget))
        st.length.copy_(torch.where(newly, st.step + 1, st.length))
        st.stopped.logical_or_(newly & hit)
        st.done.logical_or_(newly)
        self._forward(st, tok)
        st.step.add_(1)
        st.slot.add_(1)
        st.pos.add_(1)

    @staticmethod
    def _torch_sample(st: _State, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampler in torch ops (top-p, and without Triton): (token, raw log-prob) of each row."""
        logits = st.logits.float()
        if mode == "greedy":
            tok = logits.argmax(-1)
        else:
            sampled = st.temperature > 0
            scaled = logits / torch.where(sampled, st.temperature, 1.0).unsqueeze(-1)
            if mode == "top_p":
                probs = top_p_filter(torch.softmax(scaled, -1), st.top_p.unsqueeze(-1))
                scaled = probs.log()                                  # -inf outside the nucleus
            # Exponential race (Gumbel-max): argmax(log p - log E), E ~ Exp(1), draws exactly from p.
            race = scaled - torch.empty_like(scaled).exponential_().log()
            tok = torch.where(sampled, race.argmax(-1), logits.argmax(-1))
        lp = logits.gather(1, tok.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)   # raw log-prob
        return tok, lp

    def _forward(self, st: _State, tok: torch.Tensor) -> torch.Tensor:
        """One token per row through the model against the static cache; its logits into st.logits."""
        m = self.model.model
        x = m.embed_tokens(tok.unsqueeze(-1))                                     # [B, 1, d]
        cos, sin = m.rotary_emb(x, st.pos.unsqueeze(-1))
        if self.triton_attention:
            bias = None                                                         # the kernel reads pad / slot
        else:
            valid = (st.slots >= st.pad.unsqueeze(-1)) & (st.slots <= st.slot)     # [B, S]
            bias = torch.zeros(valid.shape, dtype=torch.float32, device=x.device).masked_fill_(~valid, float("-inf"))
            bias = bias[:, None, None, :]                                           # [B, 1, 1, S]
        for i, layer in enumerate(m.layers):
            wqkv, bqkv = self._qkv[i] if self._qkv is not None else (None, None)
            x = self._layer_fn(layer, x, cos, sin, bias, st.k[i], st.v[i], st.slot, st.pad, wqkv, bqkv)
        x = m.norm(x)[:, 0]
        head = self.model.lm_head
        if head.bias is None and x.dtype == st.logits.dtype:
            torch.mm(x, head.weight.t(), out=st.logits)                           # no [B, V] temporary
        else:
            st.logits.copy_(head(x))

    def _layer(self, layer, x, cos, sin, bias, kc: torch.Tensor, vc: torch.Tensor, slot: torch.Tensor,
               pad: torch.Tensor, wqkv: torch.Tensor | None = None, bqkv: torch.Tensor | None = None) -> torch.Tensor:
        """One decoder layer for one token per row; writes its k/v at `slot` of the layer's cache."""
        B, H, KV, hd = x.shape[0], self.num_heads, self.num_kv, self.head_dim
        a = layer.self_attn
        h = layer.input_layernorm(x)
        if wqkv is not None:
            q, k, v = torch.nn.functional.linear(h, wqkv, bqkv).split([H * hd, KV * hd, KV * hd], dim=-1)
        else:
            q, k, v = a.q_proj(h), a.k_proj(h), a.v_proj(h)
        q = q.reshape(B, 1, H, hd).transpose(1, 2)                               # [B, H, 1, hd]
        k = k.reshape(B, 1, KV, hd).transpose(1, 2)
        v = v.reshape(B, 1, KV, hd).transpose(1, 2)
        q, k = self._apply_rope(q, k, cos, sin)
        kc.index_copy_(2, slot, k)
        vc.index_copy_(2, slot, v)
        if bias is None:                                                         # slots [pad, slot] only
            o = decode_attention.decode_attention(q[:, :, 0], kc, vc, pad, slot, self.scaling).reshape(B, 1, H * hd)
        else:
            # Grouped query heads against their kv head: [B, KV, G, hd] x [B, KV, hd, S].
            scores = torch.matmul(q.reshape(B, KV, H // KV, hd), kc.transpose(-1, -2)).float()
            probs = torch.softmax(scores * self.scaling + bias, dim=-1).to(x.dtype)
            o = torch.matmul(probs, vc).reshape(B, 1, H * hd)
        x = x + a.o_proj(o)
        return x + layer.mlp(layer.post_attention_layernorm(x))
