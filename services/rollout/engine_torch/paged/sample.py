"""The paged decoder's sampler: each running row's next token, its raw log-prob and whether it is an eos, as device
tensors with no host sync, so a window of steps (window.py) feeds each token back into the next forward and the host
reads the whole window once.

Two modes, fixed per decode call (as cuda_decode's `_mode` and `serves` decide for the non-paged decoder):
  fused  fused_sample.py's Triton kernel (CUDA; no row with top_p < 1, none asking for top-logprobs): every row draws
         from its own Philox stream, keyed by its seed, with its token index as the counter. A seeded row's key is
         the first draw of its generator (sampling.row_generator), as the non-paged CUDA decoder derives it, so on
         CUDA a seeded paged row samples the non-paged CUDA decoder's tokens whatever batch, window or preemption
         it decodes through (not the eager loop's, which draws from the row's generator on the CPU);
  torch  sampling.sample_tokens with each row's generator, one draw per token, then log_softmax (and top-k for
         top-logprobs rows): the eager loop's samples and log-probs, on the CPU and wherever fused does not apply.
         It syncs inside (sample_tokens' checks); on the CPU that costs nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from services.common.tensors.fused import host_to_device
from services.rollout.engine_torch import fused_sample
from services.rollout.engine_torch.sampling import sample_tokens


class Drawn(NamedTuple):
    """One step's draws of R rows, on the device."""

    tok: torch.Tensor                       # int64 [R]
    logprob: torch.Tensor                   # fp32 [R], the raw model's log-softmax at tok
    eos: torch.Tensor                       # bool [R]
    top: tuple[torch.Tensor, torch.Tensor] | None = None     # ([R, k] log-probs, [R, k] ids) with top-logprobs


def fused_applies(rows, device, enabled: bool = True) -> bool:
    """Whether the fused sampler serves these engine rows' settings on `device` (else the torch sampler)."""
    if not (enabled and fused_sample.available(device)) or any(r.sampling.top_logprobs for r in rows):
        return False
    return all(r.sampling.temperature == 0 for r in rows) or all(r.sampling.top_p >= 1 for r in rows)


class StepSampler:
    """Samples the rows of one decode call; `begin` fixes the running rows of a window, `draw` samples one step."""

    def __init__(self, rows, device, eos: torch.Tensor, *, fused: bool):
        self.rows, self.device, self.eos, self.fused = rows, device, eos, fused
        self.top_k = max((r.sampling.top_logprobs for r in rows), default=0)
        if fused:
            self.seeds, self.temps = self._keys(rows)

    def _keys(self, rows) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused sampler's Philox keys and temperatures of rows: unseeded rows consecutive keys from a fresh
        draw, seeded rows their generator's first draw."""
        base = int(torch.randint(0, 2**62, (1,)).item())
        keys = [int(torch.randint(0, 2**62, (1,), generator=r.generator)) if r.generator is not None else base + i
                for i, r in enumerate(rows)]
        return (torch.tensor(keys, dtype=torch.long, device=self.device),
                torch.tensor([r.sampling.temperature for r in rows], dtype=torch.float32, device=self.device))

    def extend(self, new) -> None:
        """Rows that joined the call (already appended to its rows; continuous batching): their keys."""
        self.top_k = max(self.top_k, *(r.sampling.top_logprobs for r in new))
        if self.fused:
            seeds, temps = self._keys(new)
            self.seeds, self.temps = torch.cat([self.seeds, seeds]), torch.cat([self.temps, temps])

    def begin(self, indices: list[int], token_index: list[int]) -> None:
        """The window's rows (engine row indices, in batch order) and each one's next token's index in its
        response (the fused sampler's counter)."""
        dev, rs = self.device, [self.rows[i] for i in indices]
        self.R = len(indices)
        # No host sync: a window is launched while the one before it still runs (window.py).
        if self.fused:
            idx = host_to_device(torch.tensor(indices, dtype=torch.long), dev)
            self.temp, self.seed = self.temps.index_select(0, idx), self.seeds.index_select(0, idx)
            self.step = host_to_device(torch.tensor(token_index, dtype=torch.long), dev)
            self.scratch = fused_sample.make_scratch(self.R, dev)
        else:
            self.temp = host_to_device(torch.tensor([r.sampling.temperature for r in rs]), dev)
            self.top_p = host_to_device(torch.tensor([r.sampling.top_p for r in rs]), dev)
            self.gens = [r.generator for r in rs]
            self.tops = [r.sampling.top_logprobs for r in rs]

    def draw(self, logits: torch.Tensor, j: int) -> Drawn:
        """Step j of the window from logits [R, V], fp32 or the model's dtype (no host sync on the fused path, which
        reads either and works in fp32; the torch path takes an fp32 copy)."""
        if self.fused:
            tok = torch.empty(self.R, dtype=torch.long, device=self.device)
            lp = torch.empty(self.R, dtype=torch.float32, device=self.device)
            fused_sample.sample(logits.contiguous(), self.temp, self.seed, self.step + j if j else self.step, tok, lp,
                                self.scratch)
            return Drawn(tok, lp, torch.isin(tok, self.eos))
        logits = logits.float()
        tok = sample_tokens(logits, temperature=self.temp, top_p=self.top_p, generators=self.gens)
        logp = F.log_softmax(logits, dim=-1)
        top = None
        if self.top_k:
            t = logp.topk(min(self.top_k, logp.size(-1)), dim=-1)
            top = (t.values, t.indices)
        return Drawn(tok, logp.gather(-1, tok[:, None])[:, 0], torch.isin(tok, self.eos), top)

    def snapshot(self, steps: list[Drawn]):
        """A window's tokens, log-probs and eos flags [3, R, k] on their way to the host (an async copy on CUDA, as
        cuda_decode's stop scan), so the device goes on with the next step while the host waits for them."""
        pack = torch.stack([torch.stack([d.tok.double(), d.logprob.double(), d.eos.double()]) for d in steps], -1)
        event = None
        if pack.is_cuda:
            pack = pack.to("cpu", non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        return pack, event, steps, (self.tops if self.top_k and not self.fused else None)

    def read(self, pending) -> tuple[list, list, list, list | None]:
        """A snapshot's draws on the host, per row: tokens, log-probs, eos flags [R][k] (one sync), and top
        (id, log-prob) pairs [R][k][k_row] for top-logprobs rows (else None)."""
        pack, event, steps, tops = pending                 # tops: the window's rows' own (a later begin moves self's)
        if event is not None:
            event.synchronize()
        tok = pack[0].long().tolist()                                              # [R, k] ints
        lp, hit = pack[1:].tolist()                                                # [2, R, k]
        top = None
        if tops is not None:
            vals = torch.stack([d.top[0] for d in steps], 1).tolist()             # [R, k, top_k]
            ids = torch.stack([d.top[1] for d in steps], 1).tolist()
            top = [[list(zip(ids[b][j][:kk], vals[b][j][:kk])) for j in range(len(steps))] if kk else None
                   for b, kk in enumerate(tops)]
        return tok, lp, hit, top
