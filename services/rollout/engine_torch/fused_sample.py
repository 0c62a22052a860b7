"""One-pass sampling from rows of logits on the GPU: the next token and its raw log-prob, two Triton kernels.

The CUDA-graph decoder (cuda_decode.py) samples every row of a [B, V] logits tensor per
token. In torch that is a dozen passes over fp32 copies of the logits (cast, divide by the temperature,
draw exponentials, log, subtract, two argmaxes, logsumexp; ~4 GB of traffic per step at B=512 and
Qwen's 151,936 entries). Here the logits are read once, in their own dtype:

  part     SPLIT programs per row, each over a contiguous chunk of the vocabulary, keep per lane the running
           max and sum of exp of the raw logits (online softmax) and the best key with its column: key =
           z / T + G for sampled rows (G = -log(-log U), U uniform: the Gumbel-max draw, exactly a draw from
           softmax(z / T)), key = z for greedy rows (temperature 0);
  combine  one program per row merges its chunks: log-sum-exp, the token (the best key; among equal keys
           the lowest column, as torch.argmax) and its raw log-prob z_tok - lse, the value the eager loop
           records.

Uniforms come from Triton's Philox (rand4x: one call gives 4 columns' worth) keyed by each row's own seed,
with a per-step counter (one for the batch, or one per row: a paged row's token index), both held in device
tensors, so a captured graph replays a fresh draw every step without host syncs, and a seeded row draws the same
whatever batch, bucket or position it decodes in. Top-p sampling stays on the torch path (a sort is not a one-pass
job).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the decoder falls back to the torch sampler
    triton = None

BLOCK = 1024          # columns per loop iteration: four sub-blocks of 256 that share one Philox call
SPLIT = 8             # programs per row: each takes a contiguous chunk of the vocabulary


def available(device: torch.device) -> bool:
    """Whether the fused sampler can run for tensors on `device`."""
    return triton is not None and torch.device(device).type == "cuda"


if triton is not None:
    @triton.jit
    def _update(m, s, best, best_idx, base, idx, hi, u, sampled, inv_t):
        """Columns idx (< hi) of the row at base into a lane's running (max, sum of exp) and (best key, column)."""
        z = tl.load(base + idx, mask=idx < hi, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, z)
        live = m_new > -float("inf")
        s = s * tl.where(live, tl.exp(m - m_new), 0.0) + tl.where(live, tl.exp(z - m_new), 0.0)
        if sampled:
            key = z * inv_t - tl.log(-tl.log(u))
        else:
            key = z
        better = key > best
        return m_new, s, tl.where(better, key, best), tl.where(better, idx, best_idx)

    @triton.jit
    def _sample_part_kernel(logits_ptr, stride, V, chunk, temp_ptr, seed_ptr, step_ptr, step_stride, part_ptr,
                            part_idx_ptr, BLOCK: tl.constexpr):
        """Program (row, c): columns [c * chunk, (c + 1) * chunk) of the row -> its (max, sum, best key, column)."""
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        nsplit = tl.num_programs(1)
        base = logits_ptr + row * stride
        t = tl.load(temp_ptr + row).to(tl.float32)
        sampled = t > 0
        inv_t = 1.0 / tl.where(sampled, t, 1.0)
        seed = tl.load(seed_ptr + row)
        # The row's own Philox stream: one counter per 4 columns of every step; rand4x gives the 4 uniforms.
        groups = (V + 3) // 4
        counter0 = tl.load(step_ptr + row * step_stride) * groups
        Q: tl.constexpr = BLOCK // 4
        offs = tl.arange(0, Q)
        m = tl.full([Q], -float("inf"), tl.float32)
        s = tl.zeros([Q], tl.float32)
        best = tl.full([Q], -float("inf"), tl.float32)
        best_idx = tl.zeros([Q], tl.int32)
        lo = c * chunk
        hi = tl.minimum(lo + chunk, V)
        for start in range(lo, hi, BLOCK):
            if sampled:
                u0, u1, u2, u3 = tl.rand4x(seed, counter0 + (start // 4 + offs).to(tl.int64))
            else:                                  # greedy rows never read them
                u0 = tl.zeros([Q], tl.float32)
                u1 = u0
                u2 = u0
                u3 = u0
            i = start + offs                       # sub-block j covers columns i + j * Q, with uniforms u<j>
            m, s, best, best_idx = _update(m, s, best, best_idx, base, i, hi, u0, sampled, inv_t)
            m, s, best, best_idx = _update(m, s, best, best_idx, base, i + Q, hi, u1, sampled, inv_t)
            m, s, best, best_idx = _update(m, s, best, best_idx, base, i + 2 * Q, hi, u2, sampled, inv_t)
            m, s, best, best_idx = _update(m, s, best, best_idx, base, i + 3 * Q, hi, u3, sampled, inv_t)
        top = tl.max(best, 0)
        # The lowest column among equal keys, as torch.argmax (masked lanes carry -inf and never win).
        col = tl.min(tl.where(best == top, best_idx, V), 0)
        big = tl.max(m, 0)
        total = tl.sum(s * tl.where(m > -float("inf"), tl.exp(m - big), 0.0), 0)
        out = (row * nsplit + c) * 3
        tl.store(part_ptr + out, big)
        tl.store(part_ptr + out + 1, total)
        tl.store(part_ptr + out + 2, top)
        tl.store(part_idx_ptr + row * nsplit + c, col)

    @triton.jit
    def _sample_combine_kernel(logits_ptr, stride, V, part_ptr, part_idx_ptr, tok_ptr, lp_ptr,
                               SPLIT: tl.constexpr):
        """Row: the chunks' partials -> log-sum-exp, the token (best key; the earliest chunk among equal ones)
        and its raw log-prob."""
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, SPLIT)
        part = part_ptr + (row * SPLIT + c) * 3
        m = tl.load(part)
        s = tl.load(part + 1)
        key = tl.load(part + 2)
        col = tl.load(part_idx_ptr + row * SPLIT + c)
        big = tl.max(m, 0)
        total = tl.sum(s * tl.where(m > -float("inf"), tl.exp(m - big), 0.0), 0)
        top = tl.max(key, 0)
        tok = tl.min(tl.where(key == top, col, V), 0)
        tok = tl.minimum(tok, V - 1)           # a row of all -inf keys (cannot happen with finite logits)
        zt = tl.load(logits_ptr + row * stride + tok).to(tl.float32)
        tl.store(tok_ptr + row, tok.to(tl.int64))
        tl.store(lp_ptr + row, zt - (big + tl.log(total)))


def sample(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, step: torch.Tensor,
           tok: torch.Tensor, logprob: torch.Tensor, scratch: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Writes each row's next token (int64 [B]) and its raw log-prob (fp32 [B]) into `tok` and `logprob`.

    logits [B, V] (any float dtype, rows contiguous); temperature fp32 [B] (0 = greedy); seed int64 [B] (each
    row's Philox key: distinct rows need distinct seeds) and step int64 [1] (every row's counter) or [B] (each
    row's own: the paged decoder's rows sit at different token indices) device tensors (read by the kernel,
    so a captured graph sees their current values). `scratch`: the per-chunk partials (fp32 [B, SPLIT, 3], int32
    [B, SPLIT]) from `make_scratch`, allocated here when None (pass them under graph capture). No host sync."""
    B, V = logits.shape
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    assert step.numel() in (1, B), f"step: 1 or {B} counters (got {step.numel()})"
    part, part_idx = scratch if scratch is not None else make_scratch(B, logits.device)
    chunk = -(-triton.cdiv(V, SPLIT) // BLOCK) * BLOCK
    _sample_part_kernel[(B, SPLIT)](logits, logits.stride(0), V, chunk, temperature, seed, step,
                                    0 if step.numel() == 1 else 1, part, part_idx, BLOCK=BLOCK, num_warps=4)
    _sample_combine_kernel[(B,)](logits, logits.stride(0), V, part, part_idx, tok, logprob, SPLIT=SPLIT,
                                 num_warps=1)


def make_scratch(B: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty((B, SPLIT, 3), dtype=torch.float32, device=device),
            torch.empty((B, SPLIT), dtype=torch.int32, device=device))
