"""Sampling math of the torch engine: left-padded prompt batches, nucleus filtering, per-row sampling and
seeded row generators."""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

import torch
import torch.nn.functional as F


def left_padded(prompts: Sequence[Sequence[int]], pad_id: int, width: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts right-aligned in [P, width] rows (so the last position of every row is its last token): token ids,
    attention mask and position ids, on the CPU."""
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, q in enumerate(prompts):
        ids[i, width - len(q):] = torch.tensor(q, dtype=torch.long)
        mask[i, width - len(q):] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zeroes the tail outside the smallest set of tokens whose mass reaches top_p; [B, V] -> [B, V]."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(-1) - sorted_p
    sorted_p = sorted_p.masked_fill(mass_before >= top_p, 0.0)  # the top token always has mass_before 0
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p)


def sample_tokens(logits: torch.Tensor, *, temperature: float | torch.Tensor, top_p: float | torch.Tensor,
                  generators: Sequence[torch.Generator | None] | None) -> torch.Tensor:
    """Next token per row from fp32 logits [B, V] -> [B]; temperature, top_p and generator may differ per row.

    Rows with temperature 0 are greedy. Sampling is the exponential race argmax(p / Exp(1)) (what
    vLLM does): it draws exactly from p, and with one generator per row a seeded sample does not
    depend on what else is in the batch.
    """
    B, V = logits.shape
    temperature = torch.as_tensor(temperature, dtype=logits.dtype, device=logits.device).expand(B)
    top_p = torch.as_tensor(top_p, dtype=logits.dtype, device=logits.device).expand(B)
    greedy = logits.argmax(-1)
    sampled = temperature > 0
    if not bool(sampled.any()):
        return greedy
    probs = F.softmax(logits / torch.where(sampled, temperature, 1.0).unsqueeze(-1), dim=-1)
    if bool((top_p < 1).any()):
        probs = top_p_filter(probs, top_p.unsqueeze(-1))
    gens = list(generators) if generators is not None else [None] * B
    q = torch.empty_like(probs)
    if any(g is None for g in gens):
        q.exponential_()
    for row, g in enumerate(gens):
        if g is not None and bool(sampled[row]):
            q[row] = torch.empty(V, dtype=probs.dtype).exponential_(generator=g).to(probs.device)
    return torch.where(sampled, (probs / q).argmax(-1), greedy)


def row_generator(seed: int, prompt_ids: Sequence[int], sample_index: int) -> torch.Generator:
    """The generator of one (prompt, sample) row, a hash of the request seed, the prompt and the sample index.

    So a seeded sample does not depend on the prompt's position, the batch, the chunking or on how a
    batch was spread over replicas; the same prompt twice in one seeded request samples the same.
    """
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<qq", seed, sample_index))
    h.update(struct.pack(f"<{len(prompt_ids)}q", *prompt_ids))
    return torch.Generator().manual_seed(int.from_bytes(h.digest(), "little") & (2**63 - 1))
