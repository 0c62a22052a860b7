"""The fused log-prob head over a vocabulary split across tensor-parallel ranks (Megatron's vocab-parallel
cross-entropy, with the entropy too).

Under TP the LM head's weight is a DTensor sharded on the vocabulary (rows). Each rank multiplies the
(replicated) hidden states by its rows only and the softmax is assembled with three small all-reduces per
row chunk (max, then sum-exp, target logit and sum p*z together): no rank ever holds [tokens, vocab], let
alone the full vocabulary's logits, and none is gathered. Backward recomputes each chunk's local logits
and all-reduces the hidden-state gradient (every rank's hidden states are the same tensor).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# A chunk's fp32 [rows, local vocab] scratch stays within this many bytes (fused.CHUNK_BYTES's rule).
CHUNK_BYTES = 256 * 1024 * 1024


def _chunk_rows(local_vocab: int) -> int:
    return max(1, CHUNK_BYTES // (4 * local_vocab))


def _rows_fwd(z: torch.Tensor, targets: torch.Tensor, vocab_start: int, group):
    """(logp, entropy, lse) [n] of the rows of z = logits / T [n, V_local] over the whole vocabulary."""
    m = z.max(-1).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = (z - m.unsqueeze(-1)).exp()
    local = targets - vocab_start
    mine = (local >= 0) & (local < z.shape[1])
    zt = z.gather(1, local.clamp(0, z.shape[1] - 1).unsqueeze(-1)).squeeze(-1) * mine
    sums = torch.stack([e.sum(-1), zt, (e * z).sum(-1)])                                 # [3, n]
    dist.all_reduce(sums, group=group)
    s, zt, ez = sums
    lse = m + s.log()
    return zt - lse, lse - ez / s, lse


class _VocabParallelHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, vocab_start, group):
        n = _chunk_rows(weight.shape[0])
        out = [_rows_fwd((h @ weight.t()).float() / temperature, t, vocab_start, group)
               for h, t in zip(hidden.split(n), targets.split(n))]
        logp, ent, lse = (torch.cat(x) for x in zip(*out))
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.temperature, ctx.vocab_start, ctx.group = temperature, vocab_start, group
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp, g_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.float()
        g_ent = torch.zeros_like(lse) if g_ent is None else g_ent.float()
        g_hidden = torch.empty_like(hidden)
        g_weight = torch.zeros_like(weight, dtype=torch.float32)
        n, T, V = _chunk_rows(weight.shape[0]), ctx.temperature, weight.shape[0]
        for start in range(0, hidden.shape[0], n):
            rows = slice(start, start + n)
            h = hidden[rows]
            logp_all = (h @ weight.t()).float() / T - lse[rows].unsqueeze(-1)
            p = logp_all.exp()
            gl, ge = g_logp[rows].unsqueeze(-1), g_ent[rows].unsqueeze(-1)
            dz = -gl * p - ge * p * (logp_all + ent[rows].unsqueeze(-1))
            local = targets[rows] - ctx.vocab_start
            mine = (local >= 0) & (local < V)
            dz.scatter_add_(1, local.clamp(0, V - 1).unsqueeze(-1), (g_logp[rows] * mine).unsqueeze(-1))
            dz = (dz / T).to(hidden.dtype)
            g_hidden[rows] = dz @ weight
            g_weight += (dz.t() @ h).float()
        # Each rank's rows of the vocabulary give part of d/d hidden: the sum is the whole of it.
        dist.all_reduce(g_hidden, group=ctx.group)
        return g_hidden, g_weight.to(weight.dtype), None, None, None, None


def vocab_parallel_logprobs(hidden: torch.Tensor, weight, targets: torch.Tensor, temperature: float = 1.0):
    """(logp, entropy) [N] fp32 of the targets [N] under softmax(hidden [N, d] @ weight^T / T), `weight` a
    [V, d] DTensor sharded on dim 0 over a 1-D (tensor-parallel) mesh; `hidden` the same on every rank."""
    from torch.distributed.tensor import Shard

    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise ValueError(f"vocab-parallel head: expected a weight sharded on dim 0 over one mesh axis, got "
                         f"{weight.placements} over {mesh.ndim} axes")
    if hasattr(hidden, "full_tensor"):
        hidden = hidden.full_tensor()
    local = weight.to_local()                                   # differentiable: the grad lands on the DTensor
    rows = weight.shape[0] // mesh.size()
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else local.dtype
    return _VocabParallelHead.apply(hidden.to(dtype), local.to(dtype), targets, float(temperature),
                                    mesh.get_local_rank() * rows, mesh.get_group())
