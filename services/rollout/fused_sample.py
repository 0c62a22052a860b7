"""One-pass sampling from a row of logits on the GPU: the next token and its raw log-prob in one Triton kernel.

The CUDA-graph decoder (services/rollout/cuda_decode.py) samples every row of a [B, V] logits tensor per
token. In torch that is a dozen passes over fp32 copies of the logits (cast, divide by the temperature,
draw exponentials, log, subtract, two argmaxes, logsumexp; ~4 GB of traffic per step at B=512 and
Qwen's 151,936 entries). Here each row is read once, in the logits' own dtype, and the kernel keeps:

  - the running max and sum of exp of the raw logits (online softmax) -> log-sum-exp -> the raw log-prob
    of the chosen token, the value the eager loop records;
  - the running best key and its index, key = z / T + G for sampled rows (G = -log(-log U), U uniform
    from Philox: the Gumbel-max draw, exactly a draw from softmax(z / T)) and key = z for greedy rows
    (temperature 0); among equal keys the lowest index wins, as torch.argmax.

Random numbers come from Triton's Philox with a per-call seed and a per-step counter held in device
tensors, so a captured graph replays a fresh draw every step without host syncs. Top-p sampling stays
on the torch path (a sort is not a one-pass job).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the decoder falls back to the torch sampler
    triton = None

BLOCK = 2048


def available(device: torch.device) -> bool:
    """Whether the fused sampler can run for tensors on `device`."""
    return triton is not None and torch.device(device).type == "cuda"


if triton is not None:
    @triton.jit
    def _sample_kernel(logits_ptr, stride, V, temp_ptr, seed_ptr, step_ptr, tok_ptr, lp_ptr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        rows = tl.num_programs(0).to(tl.int64)
        base = logits_ptr + row * stride
        t = tl.load(temp_ptr + row).to(tl.float32)
        sampled = t > 0
        inv_t = tl.where(sampled, 1.0 / tl.where(sampled, t, 1.0), 1.0)
        seed = tl.load(seed_ptr)
        # A distinct Philox counter for every (step, row, column).
        counter0 = (tl.load(step_ptr) * rows + row) * V
        offs = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], -float("inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        best = tl.full([BLOCK], -float("inf"), tl.float32)
        best_idx = tl.zeros([BLOCK], tl.int32)
        for start in range(0, V, BLOCK):
            idx = start + offs
            valid = idx < V
            z = tl.load(base + idx, mask=valid, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, z)
            live = m_new > -float("inf")
            s = s * tl.where(live, tl.exp(m - m_new), 0.0) + tl.where(live, tl.exp(z - m_new), 0.0)
            m = m_new
            if sampled:
                u = tl.rand(seed, counter0 + idx.to(tl.int64))
                key = z * inv_t - tl.log(-tl.log(u))
            else:
                key = z
            better = key > best
            best = tl.where(better, key, best)
            best_idx = tl.where(better, idx, best_idx)
        top = tl.max(best, 0)
        tok = tl.min(tl.where(best == top, best_idx, V), 0)
        tok = tl.minimum(tok, V - 1)           # a row of all -inf keys (cannot happen with finite logits)
        big = tl.max(m, 0)
        total = tl.sum(s * tl.where(m > -float("inf"), tl.exp(m - big), 0.0), 0)
        zt = tl.load(base + tok).to(tl.float32)
        tl.store(tok_ptr + row, tok.to(tl.int64))
        tl.store(lp_ptr + row, zt - (big + tl.log(total)))


def sample(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, step: torch.Tensor,
           tok: torch.Tensor, logprob: torch.Tensor) -> None:
    """Writes each row's next token (int64 [B]) and its raw log-prob (fp32 [B]) into `tok` and `logprob`.

    logits [B, V] (any float dtype, rows contiguous); temperature fp32 [B] (0 = greedy); seed and step int64 [1]
    device tensors (read by the kernel, so a captured graph sees their current values). No host sync."""
    B, V = logits.shape
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    _sample_kernel[(B,)](logits, logits.stride(0), V, temperature, seed, step, tok, logprob, BLOCK=BLOCK,
                         num_warps=8)
