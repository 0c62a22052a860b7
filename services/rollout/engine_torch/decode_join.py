"""The GraphDecoder's side of continuous batching (rollout.continuous_batching; the engine's is continuous.py).

At each sync of a decode (every `sync_every` steps, where the `done` flags are read anyway), rows that ended are
handed out and their batch rows freed; rows that arrived meanwhile then take them: their prompts are prefilled
(the engine's prefill, one forward for the joiners) and their KV copied into the slots just before the shared
current slot c (pad = c - prompt length), so each row's attention sees its own prompt and tokens only. A row's
token i sits in column start + i and `budget` holds its absolute end step (start + budget), so the captured step
is unchanged: everything here is a buffer write between two replays. The Philox counter is the shared step, so
joiners are unseeded; stop-string scans start at step 0, so a decode with stop strings takes none.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from services.rollout.engine_torch.lora import adapter_rows
from services.rollout.engine_torch.sampling import left_padded


class Room(NamedTuple):
    """What a running decode can take at a sync (see GraphDecoder.decode's join)."""

    free: int                 # batch rows free now
    step: int                 # the shared step the joiners' first token is sampled at
    slot: int                 # the cache slot of that step: a prompt must fit before it
    size: int                 # cache slots per row: slot + budget must fit
    sampler: str              # the running graph's mode (greedy, sample, top_p)
    top_logprobs: bool        # whether it records top-logprobs

    def takes(self, temperature: float, top_p: float, top_logprobs: int = 0) -> bool:
        """Whether the running graph samples an unseeded row of these settings (greedy rows fit any mode)."""
        mode_ok = temperature == 0 or self.sampler == "top_p" or (self.sampler == "sample" and top_p >= 1)
        return mode_ok and (self.top_logprobs or not top_logprobs)

    def fits(self, prompt_len: int, budget: int) -> bool:
        """Whether a row's prompt fits before the current slot and its budget after it."""
        return prompt_len <= self.slot and self.slot + budget <= self.size


class Joiner(NamedTuple):
    """A row that joins a running decode."""

    prompt: Sequence[int]
    budget: int
    temperature: float
    top_p: float
    slot: int = 0             # its LoRA adapter's slot (lora.py); 0 = the base model


def decode(dec, st, mode: tuple[str, bool], graph, L: int, R: int, budgets, between_steps, join, ended) -> tuple:
    """GraphDecoder.decode with rows joining at syncs into the batch rows of rows that ended (and the dummy
    ones): (tokens, logprobs, stopped, top) per row id."""
    owner: list[int | None] = list(range(R)) + [None] * (st.B - R)     # row id in each batch row
    start = [0] * R                                                   # each row id's first step
    outs: dict[int, tuple] = {}
    horizon, i = max(budgets), -1                                     # every row ends by step horizon
    while True:
        i += 1
        if graph is not None:
            graph.replay()
        else:
            dec._step(st, mode)
        if (i + 1) % dec.sync_every and i + 1 < horizon:
            continue
        done = st.done.tolist()
        gone = [b for b, r in enumerate(owner) if r is not None and done[b]]
        if gone:
            out = _collect(dec, st, gone, [start[owner[b]] for b in gone], mode[1])
            new = {owner[b]: o for b, o in zip(gone, out)}
            outs.update(new)
            for b in gone:
                owner[b] = None
            if ended is not None:
                ended(new)
        if between_steps is not None:
            between_steps(i)
        free = [b for b, r in enumerate(owner) if r is None]
        room = Room(len(free), i + 1, L + i + 1, st.S, mode[0], mode[1])
        rows = list(join(room)) if free else []
        assert len(rows) <= room.free and all(room.fits(len(j.prompt), j.budget) and room.takes(
            j.temperature, j.top_p) for j in rows), "join: rows that do not fit the room"
        if rows:
            _admit(dec, st, rows, free[:len(rows)], room)
            for b in free[:len(rows)]:
                owner[b] = len(start)
                start.append(i + 1)
            horizon = max(horizon, i + 1 + max(j.budget for j in rows))
            dec.stats["joined_rows"] += len(rows)
        elif all(r is None for r in owner):
            break
    dec.stats["replays"] += i + 1
    got = [outs[r] for r in range(len(start))]
    return tuple([o[f] for o in got] for f in range(3)) + ([o[3] for o in got] if mode[1] else None,)


def _collect(dec, st, rows: list[int], starts: list[int], with_top: bool) -> list[tuple]:
    """(tokens, raw log-probs, stopped, top or None) of batch rows that ended, their tokens from their start."""
    idx = torch.tensor(rows, device=dec.device)
    ends, stopped = st.length.index_select(0, idx).tolist(), st.stopped.index_select(0, idx).tolist()
    lo, hi = min(starts), max(ends)
    tok = st.out_tok[:, lo:hi].index_select(0, idx).tolist()
    lp = st.out_lp[:, lo:hi].index_select(0, idx).tolist()
    if with_top:
        ti = st.top_ids[:, lo:hi].index_select(0, idx).tolist()
        tv = st.top_lp[:, lo:hi].index_select(0, idx).tolist()
    out = []
    for j, (s, e) in enumerate(zip(starts, ends)):
        a, z = s - lo, e - lo
        top = [list(zip(ti[j][t], tv[j][t])) for t in range(a, z)] if with_top else None
        out.append((tok[j][a:z], lp[j][a:z], bool(stopped[j]), top))
    return out


def _admit(dec, st, rows: Sequence[Joiner], batch_rows: list[int], room: Room) -> None:
    """Joiners into free batch rows: their prefill (the engine's), KV into slots [slot - len, slot), logits,
    and per-row settings (buffers only: the captured graphs read them)."""
    from transformers import DynamicCache

    dev, c = dec.device, room.slot
    uniq: dict[tuple[int, tuple[int, ...]], int] = {}
    fan = [uniq.setdefault((j.slot, tuple(j.prompt)), len(uniq)) for j in rows]
    Lj = max(len(q) for _, q in uniq)
    ids, mask, pos = left_padded([q for _, q in uniq], dec.pad_id, Lj)
    cache = DynamicCache(config=dec.model.config)
    with adapter_rows(dec.adapters, [s for s, _ in uniq]):
        out = dec.model(input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev),
                        past_key_values=cache, use_cache=True, logits_to_keep=1)
    fan_t, at = torch.tensor(fan, dtype=torch.long, device=dev), torch.tensor(batch_rows, device=dev)
    if dec.adapters is not None:          # the joiners' adapters in their batch rows, read by the captured step
        dec.adapters.set_decode_rows([j.slot for j in rows], at)
    st.logits.index_copy_(0, at, out.logits[:, -1, :].index_select(0, fan_t).to(st.logits.dtype))
    for layer, (k, v) in enumerate(zip(st.k, st.v)):
        # Left-padded to Lj: the pad part lands in slots [c - Lj, c - len), outside the row's [pad, slot].
        k[:, :, c - Lj:c].index_copy_(0, at, cache.layers[layer].keys.index_select(0, fan_t))
        v[:, :, c - Lj:c].index_copy_(0, at, cache.layers[layer].values.index_select(0, fan_t))
    lens = torch.tensor([len(j.prompt) for j in rows], dtype=torch.long, device=dev)
    st.pos.index_copy_(0, at, lens)
    st.pad.index_copy_(0, at, c - lens)
    st.budget.index_copy_(0, at, room.step + torch.tensor([j.budget for j in rows], device=dev))
    st.temperature.index_copy_(0, at, torch.tensor([float(j.temperature) for j in rows], device=dev))
    st.top_p.index_copy_(0, at, torch.tensor([float(j.top_p) for j in rows], device=dev))
    st.seed.index_copy_(0, at, torch.randint(0, 2**62, (len(rows),), device=dev))
    st.length.index_fill_(0, at, 0)
    st.stopped.index_fill_(0, at, False)
    st.done.index_fill_(0, at, False)
