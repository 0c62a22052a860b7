"""How the torch engine decodes a chunk of rows: the row record, the eager KV-cache loop with its prefill and
stop strings, and the hand-off to the CUDA-graph decoder (cuda_decode.py) where it serves the rows.

engine.py decides which rows decode together and when weight swaps land; this module runs one decode of them.
Left padding and a KV cache, so that every sampled token's log-prob is the raw-model log-prob the trainer will
recompute.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F

from services.rollout.engine_torch.continuous import Flight, Joining, fill_row, graph_decode
from services.rollout.engine_torch.lora import adapter_rows
from services.rollout.engine_torch.sampling import left_padded, sample_tokens
from services.rollout.types import SamplingParams


@dataclass
class Row:
    """Decode state of one (prompt, sample) row, with its request's sampling settings."""

    prompt: list[int]
    budget: int                                   # new tokens this row may produce
    sampling: SamplingParams
    generator: torch.Generator | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    text: str | None = None                       # set when a stop string cut it
    top: list[list[tuple[int, float]]] | None = None
    version: int = 0                              # the weight version its decode started on
    start: int = 0                                # the decode step of its first token (a row that joined later)
    # (first token index, version) of each weight swap that landed while it decoded (partial rollouts)
    swaps: list[tuple[int, int]] = field(default_factory=list)
    cached: int = 0                               # prompt tokens the paged cache did not prefill for it
    slot: int = 0                                 # its LoRA adapter's slot (lora.py); 0 = the base model
    episode: str = ""                             # its episode's id (paged KV pins the episode's blocks)

    def weight_versions(self) -> list[int] | None:
        """Per token, the version whose forward produced it; None when no swap landed inside its tokens."""
        swaps = [(i, v) for i, v in self.swaps if i < len(self.tokens)]
        if not swaps:
            return None
        out, version, at = [], self.version, 0
        for i, v in swaps:
            out += [version] * (i - at)
            version, at = v, i
        return out + [version] * (len(self.tokens) - at)


@dataclass
class _Outputs:
    """What a decode produced per row, kept in tensors (one op per step, not one Python step per row)."""

    tokens: torch.Tensor                          # [R, T]
    logprobs: torch.Tensor                        # [R, T]
    top_ids: torch.Tensor | None                  # [R, T, k] when some row asked for top-logprobs
    top_logprobs: torch.Tensor | None             # [R, T, k]
    lengths: torch.Tensor                         # [R]
    stopped: torch.Tensor                         # [R] eos or a stop string

    @classmethod
    def empty(cls, rows: list[Row], vocab_size: int, device) -> _Outputs:
        R, T = len(rows), max(r.budget for r in rows)
        k = min(max(r.sampling.top_logprobs for r in rows), vocab_size)
        return cls(torch.zeros((R, T), dtype=torch.long, device=device),
                   torch.zeros((R, T), dtype=torch.float32, device=device),
                   torch.zeros((R, T, k), dtype=torch.long, device=device) if k else None,
                   torch.zeros((R, T, k), dtype=torch.float32, device=device) if k else None,
                   torch.zeros(R, dtype=torch.long, device=device), torch.zeros(R, dtype=torch.bool, device=device))

    def record(self, active: torch.Tensor, step: int, tok: torch.Tensor, logp: torch.Tensor) -> None:
        """The sampled tokens of the running rows at `step`, their raw log-probs and the top-k."""
        self.tokens[active, step] = tok
        self.logprobs[active, step] = logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
        if self.top_ids is not None:
            top_v, top_i = logp.topk(self.top_ids.size(-1), dim=-1)
            self.top_ids[active, step], self.top_logprobs[active, step] = top_i, top_v

    def write_to(self, rows: list[Row]) -> None:
        tok_l, lp_l = self.tokens.tolist(), self.logprobs.tolist()
        len_l, stop_l = self.lengths.tolist(), self.stopped.tolist()
        if self.top_ids is not None:
            ti_l, tv_l = self.top_ids.tolist(), self.top_logprobs.tolist()
        for a, row in enumerate(rows):
            L = len_l[a]
            row.tokens, row.logprobs = tok_l[a][:L], lp_l[a][:L]
            row.finish_reason = "stop" if stop_l[a] else "length"
            k = row.sampling.top_logprobs
            if k:
                row.top = [list(zip(ti_l[a][t][:k], tv_l[a][t][:k])) for t in range(L)]


@torch.inference_mode()
def decode_rows(engine, rows: list[Row], *, partial: str = "off", flight: Flight | None = None) -> None:
    """Decodes rows together (call in the engine's worker thread, under its lock): with the CUDA-graph decoder where
    it serves their sampling settings, else with the eager loop. partial (continue / pause): posted weight swaps
    land between two steps (engine._between_steps); pause recomputes the running rows' KV cache with the new
    weights (on the eager loop, not the graph one)."""
    if engine._paged is not None:
        return _paged_decode(engine, rows, partial, flight)
    dec = engine._graph_decoder
    if partial != "pause" and dec is not None and dec.serves(
            [r.generator is not None for r in rows], [r.sampling.temperature for r in rows],
            [r.sampling.top_p for r in rows]):
        return _graph_decode(engine, rows, partial=partial != "off", flight=flight)
    _eager_decode(engine, rows, partial)


def _eager_decode(engine, rows: list[Row], partial: str) -> None:
    """Left-padded prefill, then one token per step for the rows still running.

    Rows that finish are dropped from the batch (and the KV cache), so long tails do not pay for finished rows.
    """
    dev, model, bank = engine.device, engine.model, engine.adapters
    slots = torch.tensor([r.slot for r in rows], dtype=torch.long, device=dev)
    cache, logits, mask, next_pos = _prefill(model, [r.prompt for r in rows], engine.pad_id, dev, bank,
                                             slots.tolist())
    out = _Outputs.empty(rows, engine.vocab_size, dev)
    budget = torch.tensor([r.budget for r in rows], dtype=torch.long, device=dev)
    eos = torch.tensor(sorted(engine.eos_ids) or [-1], dtype=torch.long, device=dev)
    temperature = torch.tensor([r.sampling.temperature for r in rows], dtype=torch.float32, device=dev)
    top_p = torch.tensor([r.sampling.top_p for r in rows], dtype=torch.float32, device=dev)
    gens = [r.generator for r in rows]
    with_stops = any(r.sampling.stop for r in rows)
    active = torch.arange(len(rows), device=dev)                       # row index of each batch row
    step = 0
    while True:
        logp = F.log_softmax(logits, dim=-1)                              # raw distribution, fp32
        act = active.tolist()
        tok = sample_tokens(logits, temperature=temperature[active], top_p=top_p[active],
                            generators=[gens[a] for a in act])
        out.record(active, step, tok, logp)
        hit = torch.isin(tok, eos)
        if with_stops:
            _mark_stop_strings(engine, hit, rows, act, out.tokens, step)
        done = hit | (step + 1 >= budget[active])
        out.stopped[active[hit]] = True
        out.lengths[active[done]] = step + 1
        if bool(done.all()):
            break
        if bool(done.any()):
            keep = (~done).nonzero().flatten()
            cache.batch_select_indices(keep)
            tok, mask, next_pos, active = tok[keep], mask[keep], next_pos[keep], active[keep]
        if partial != "off" and engine._between_steps(rows, step + 1) and partial == "pause":
            # The running rows' prompt and tokens so far through the new weights: a fresh KV cache.
            running = [rows[a].prompt + out.tokens[a, :step + 1].tolist() for a in active.tolist()]
            cache, logits, mask, next_pos = _prefill(model, running, engine.pad_id, dev, bank, slots[active].tolist())
        else:
            mask = torch.cat([mask, mask.new_ones((mask.size(0), 1))], dim=1)
            with adapter_rows(bank, slots[active]):
                logits = model(input_ids=tok.unsqueeze(-1), attention_mask=mask, position_ids=next_pos,
                               past_key_values=cache, use_cache=True).logits[:, -1, :].float()
            next_pos = next_pos + 1
        step += 1
    out.write_to(rows)


def _prefill(model, sequences: list[list[int]], pad_id: int, device, bank=None, slots: Sequence[int] | None = None):
    """Runs each distinct (adapter slot, sequence) once (left-padded), then fans its KV cache out to the rows that
    share it.

    Returns the cache, the last logits [R, V] (fp32), the attention mask [R, L] and the next positions [R, 1].
    """
    from transformers import DynamicCache

    slots = list(slots) if slots is not None else [0] * len(sequences)
    uniq: dict[tuple[int, tuple[int, ...]], int] = {}
    fan = [uniq.setdefault((s, tuple(q)), len(uniq)) for s, q in zip(slots, sequences)]
    prompts = [q for _, q in uniq]
    L = max(len(q) for q in prompts)
    ids, mask, pos = left_padded(prompts, pad_id, L)
    ids, mask, pos = ids.to(device), mask.to(device), pos.to(device)
    cache = DynamicCache(config=model.config)
    with adapter_rows(bank, [s for s, _ in uniq]):
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
    logits = out.logits[:, -1, :].float()
    fan_t = torch.tensor(fan, dtype=torch.long, device=device)
    if len(prompts) != len(sequences) or fan != list(range(len(sequences))):
        cache.batch_select_indices(fan_t)
        logits, mask, pos = logits[fan_t], mask[fan_t], pos[fan_t]
    return cache, logits, mask, pos[:, -1:] + 1


def _mark_stop_strings(engine, hit: torch.Tensor, rows: list[Row], act: list[int], tokens: torch.Tensor,
                       step: int) -> None:
    """Sets `hit` for the running rows whose response now holds one of their stop strings."""
    for b in (~hit).nonzero().flatten().tolist():
        row = rows[act[b]]
        stops = row.sampling.stop
        if stops and _hit_stop(engine, row, tokens[act[b], :step + 1].tolist(), stops):
            hit[b] = True


def _paged_decode(engine, rows: list[Row], partial: str = "off", flight: Flight | None = None) -> None:
    """The paged KV cache's decode (paged/decoder.py): the prefix cache, forks and preemption live there; partial
    rollouts land swaps between its steps (engine._swap_point) and tag each row's tokens there. With continuous
    batching, rows of requests pending meanwhile join it between windows and each request is answered as soon as its
    rows ended (continuous.py's Joining); rows of a joined request still waiting when the decode ended decode next,
    in this same call."""
    def stop_check(r: int, tokens: list[int]) -> bool:
        return _hit_stop(engine, rows[r], tokens, rows[r].sampling.stop)

    joining = Joining(engine, flight, rows) if flight is not None and engine.config.continuous_batching else None
    while rows:
        engine._paged.decode(rows, engine.weight_version, eos_ids=sorted(engine.eos_ids), stop_check=stop_check,
                             swap_point=engine._swap_point if partial != "off" else None, pause=partial == "pause",
                             joins=joining)
        if joining is None:
            return
        joining.rows_ended(rows)
        rows = joining.next_rows(engine.max_batch_size)
        version = engine._swap_point() if partial != "off" else engine.weight_version
        for row in rows:
            row.version = version
        joining.restart(rows)


def _graph_decode(engine, rows: list[Row], *, partial: bool = False, flight: Flight | None = None) -> None:
    """The same decode as the eager loop, each step one CUDA graph replay (rows stay in the batch until all end, or
    with continuous batching, give their batch row to pending requests' rows)."""
    if flight is not None and engine.config.continuous_batching and not any(r.sampling.stop for r in rows):
        return graph_decode(engine, rows, flight)

    def stop_check(r: int, tokens: list[int], since: int) -> bool:
        # The tail from `since` back by the longest stop string (each token is >= 1 character) first: a bounded
        # decode per row and sync; the whole response only once a stop string is there.
        stops = rows[r].sampling.stop
        if not stops or not any(x in engine.decode(tokens[max(0, since - max(map(len, stops))):]) for x in stops):
            return False
        return _hit_stop(engine, rows[r], tokens, stops)

    # A seeded row's Philox key: the first draw of its generator (a hash of seed, prompt and sample index).
    seeds = [int(torch.randint(0, 2**62, (1,), generator=r.generator)) if r.generator is not None else None
             for r in rows]
    out = engine._graph_decoder.decode(
        [r.prompt for r in rows], [r.budget for r in rows], [r.sampling.temperature for r in rows],
        [r.sampling.top_p for r in rows], seeds=seeds, slots=[r.slot for r in rows],
        top_logprobs=max(r.sampling.top_logprobs for r in rows),
        stop_check=stop_check if any(r.sampling.stop for r in rows) else None,
        # the logits of token i + 1 were computed before the boundary after step i: the swap shows from i + 2
        between_steps=(lambda i: engine._between_steps(rows, i + 2)) if partial else None)
    for i, row in enumerate(rows):
        fill_row(row, out.tokens[i], out.logprobs[i], out.stopped[i], out.top[i] if out.top is not None else None)


def _hit_stop(engine, row: Row, tokens: list[int], stops: Sequence[str]) -> bool:
    """True when the decoded response contains a stop string; the text is cut before it (as in vLLM)."""
    text = engine.decode(tokens)
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    if cut < 0:
        return False
    row.text = text[:cut]
    return True
