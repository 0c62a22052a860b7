"""An LM head fused with its log-softmax: response log-probs and entropy from hidden states (trainer, reference).

The plain path (services.common.tensors.modeling.response_logprobs) materialises [B, L, V] logits, gathers a
[B, R, V] copy, casts it to fp32, log-softmaxes and exps it: several fp32 tensors of tokens x vocab
(10 GB each at 16k tokens and Qwen's 151,936 entries). Here the backbone's hidden states are taken at
the response positions first (padding is never sent through the head), then:

  CUDA + Triton   logits = hidden @ W^T in the compute dtype (what the model's own lm_head makes),
                  one row kernel for log-prob + entropy (online softmax, fp32 math), one that writes
                  the logit gradient over the saved logits in place: only the bf16 logits live on.
  otherwise       the same math in pure torch over row chunks; backward recomputes each chunk's logits
                  (one more head matmul) so no [tokens, vocab] tensor outlives a chunk.

Same outputs as the plain path: fp32 on CPU within a few ulps (values) and 1e-5 (gradients), see
tests/unit/test_fused_logprobs.py; bf16 on the GPU, see tests/gpu/test_fused_logprobs.py.
"""

from __future__ import annotations

import types

import torch
from torch import nn

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the pure-torch path below
    triton = None

# A chunk's fp32 [rows, vocab] scratch stays within this many bytes on the pure-torch path.
CHUNK_BYTES = 256 * 1024 * 1024

if triton is not None:
    @triton.jit
    def _head_fwd_kernel(logits_ptr, target_ptr, logp_ptr, ent_ptr, lse_ptr, stride, V, temperature,
                         BLOCK: tl.constexpr):
        """One row: log-softmax of logits / T at the target and the entropy, in one pass (online softmax)."""
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        offs = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], -float("inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        w = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            idx = start + offs
            z = tl.load(base + idx, mask=idx < V, other=-float("inf")).to(tl.float32) / temperature
            m_new = tl.maximum(m, z)
            live = m_new > -float("inf")
            alpha = tl.where(live, tl.exp(m - m_new), 0.0)
            e = tl.where(live, tl.exp(z - m_new), 0.0)
            s = s * alpha + e
            w = w * alpha + tl.where(e > 0, e * z, 0.0)
            m = m_new
        big = tl.max(m, 0)
        scale = tl.where(m > -float("inf"), tl.exp(m - big), 0.0)
        total = tl.sum(s * scale, 0)
        lse = big + tl.log(total)
        t = tl.load(target_ptr + row)
        zt = tl.load(base + t).to(tl.float32) / temperature
        tl.store(logp_ptr + row, zt - lse)
        tl.store(ent_ptr + row, lse - tl.sum(w * scale, 0) / total)
        tl.store(lse_ptr + row, lse)

    @triton.jit
    def _head_bwd_kernel(logits_ptr, target_ptr, lse_ptr, ent_ptr, glogp_ptr, gent_ptr, stride, V, temperature,
                         BLOCK: tl.constexpr):
        """d(g_logp * logp + g_ent * H)/d logits, written over the logits (compute dtype) in place."""
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        offs = tl.arange(0, BLOCK)
        lse = tl.load(lse_ptr + row)
        h = tl.load(ent_ptr + row)
        gl = tl.load(glogp_ptr + row)
        ge = tl.load(gent_ptr + row)
        t = tl.load(target_ptr + row)
        for start in range(0, V, BLOCK):
            idx = start + offs
            mask = idx < V
            u = tl.load(base + idx, mask=mask, other=0.0).to(tl.float32) / temperature
            logp = u - lse
            p = tl.exp(logp)
            du = -gl * p - ge * p * (logp + h) + tl.where(idx == t, gl, 0.0)
            tl.store(base + idx, (du / temperature).to(logits_ptr.dtype.element_ty), mask=mask)


def triton_rows_fwd(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """(logp, entropy, lse) [N] fp32 of each row of logits [N, V] (Triton; any device Triton runs on)."""
    N, V = logits.shape
    out = torch.empty((3, N), dtype=torch.float32, device=logits.device)
    _head_fwd_kernel[(N,)](logits, targets, out[0], out[1], out[2], logits.stride(0), V, float(temperature),
                           BLOCK=4096, num_warps=8)
    return out[0], out[1], out[2]


def triton_rows_bwd_(logits, targets, lse, ent, g_logp, g_ent, temperature: float) -> torch.Tensor:
    """Overwrites logits [N, V] with the gradient of sum(g_logp * logp + g_ent * entropy) (Triton)."""
    N, V = logits.shape
    _head_bwd_kernel[(N,)](logits, targets, lse, ent, g_logp.contiguous(), g_ent.contiguous(), logits.stride(0),
                           V, float(temperature), BLOCK=4096, num_warps=8)
    return logits


def rows_fwd(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """Pure-torch triton_rows_fwd: (logp, entropy, lse) [N] fp32 of logits [N, V]."""
    z = logits.float() / temperature
    lse = torch.logsumexp(z, -1)                                                    # [N]
    logp_all = z - lse.unsqueeze(-1)
    logp = logp_all.gather(1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy, lse


def rows_grad(logits, targets, lse, ent, g_logp, g_ent, temperature: float) -> torch.Tensor:
    """Pure-torch gradient [N, V] (fp32) of sum(g_logp * logp + g_ent * entropy) w.r.t. logits [N, V].

    d logp_t / dz = onehot_t - p;  d H / dz = -p * (logp + H);  z = logits / T.
    """
    logp_all = logits.float() / temperature - lse.unsqueeze(-1)
    p = logp_all.exp()
    dz = -g_logp.unsqueeze(-1) * p - g_ent.unsqueeze(-1) * p * (logp_all + ent.unsqueeze(-1))
    dz.scatter_add_(1, targets.unsqueeze(-1), g_logp.unsqueeze(-1))
    return dz / temperature


def _chunk_rows(vocab: int) -> int:
    return max(1, CHUNK_BYTES // (4 * vocab))


class _TritonHeadLogprobs(torch.autograd.Function):
    """logp, entropy of hidden [N, d] @ weight [V, d]^T; keeps the logits (compute dtype) for backward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature):
        logits = hidden @ weight.t()                                                  # [N, V]
        logp, ent, lse = triton_rows_fwd(logits, targets, temperature)
        ctx.save_for_backward(hidden, weight, targets, logits, lse, ent)
        ctx.temperature = temperature
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp, g_ent):
        hidden, weight, targets, logits, lse, ent = ctx.saved_tensors
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.float()
        g_ent = torch.zeros_like(lse) if g_ent is None else g_ent.float()
        dlogits = triton_rows_bwd_(logits, targets, lse, ent, g_logp, g_ent, ctx.temperature)
        g_hidden = dlogits @ weight if ctx.needs_input_grad[0] else None
        g_weight = dlogits.t() @ hidden if ctx.needs_input_grad[1] else None
        return g_hidden, g_weight, None, None


class _ChunkedHeadLogprobs(torch.autograd.Function):
    """The same in pure torch over row chunks; backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature):
        n = _chunk_rows(weight.shape[0])
        out = [rows_fwd(h @ weight.t(), t, temperature) for h, t in zip(hidden.split(n), targets.split(n))]
        logp, ent, lse = (torch.cat(x) for x in zip(*out))
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.temperature = temperature
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp, g_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.float()
        g_ent = torch.zeros_like(lse) if g_ent is None else g_ent.float()
        g_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        g_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        n = _chunk_rows(weight.shape[0])
        for start in range(0, hidden.shape[0], n):
            rows = slice(start, start + n)
            h = hidden[rows]
            dlogits = rows_grad(h @ weight.t(), targets[rows], lse[rows], ent[rows], g_logp[rows], g_ent[rows],
                                ctx.temperature).to(hidden.dtype)
            if g_hidden is not None:
                g_hidden[rows] = dlogits @ weight
            if g_weight is not None:
                g_weight += (dlogits.t() @ h).float()
        return g_hidden, None if g_weight is None else g_weight.to(weight.dtype), None, None


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """(logp, entropy) [N] fp32 of the targets [N] under softmax(hidden [N, d] @ weight [V, d]^T / T).

    Triton kernels on CUDA when Triton is installed, the chunked pure-torch path otherwise. Without gradients
    (log-prob passes) the rows go in chunks on CUDA too: no [tokens, vocab] tensor at all, only a chunk's.
    """
    on_triton = hidden.is_cuda and triton is not None
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        fwd, n = (triton_rows_fwd if on_triton else rows_fwd), _chunk_rows(weight.shape[0])
        out = [fwd(h @ weight.t(), t, temperature)[:2] for h, t in zip(hidden.split(n), targets.split(n))]
        return torch.cat([o[0] for o in out]), torch.cat([o[1] for o in out])
    fn = _TritonHeadLogprobs if on_triton else _ChunkedHeadLogprobs
    return fn.apply(hidden, weight, targets, float(temperature))


def supports_fused_head(model: nn.Module) -> str | None:
    """Why `model`'s head cannot be fused (None when it can): it must be a bias-free nn.Linear over
    `model.model`'s last hidden state, unsharded (a TP head splits the vocabulary: the plain path then),
    with no logit soft-capping or scaling."""
    head, backbone = getattr(model, "lm_head", None), getattr(model, "model", None)
    if not isinstance(head, nn.Linear) or backbone is None:
        return "no nn.Linear lm_head over model.model"
    if head.bias is not None:
        return "lm_head has a bias"
    if hasattr(head.weight, "placements"):
        return "lm_head is tensor-parallel (a DTensor)"
    cfg = getattr(model, "config", None)
    for key in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(cfg, key, None) not in (None, 1, 1.0):
            return f"config.{key} is set"
    return None


def _forward(self, input_ids=None, attention_mask=None, *, logprob_index=None, temperature: float = 1.0, **kwargs):
    """The model's own forward, or, given logprob_index = (src [N], targets [N]), the fused head at the
    flat positions `src` of the hidden states: (logp [N], entropy [N]). `kwargs` (position ids and packed
    sequences, see services/common/tensors/packing.py) go to the backbone. Runs inside the module's __call__ so
    FSDP's and DDP's hooks see it like any forward."""
    if logprob_index is None:
        return self._plain_forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    src, targets = logprob_index
    hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs).last_hidden_state
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, src)                          # [N, d]
    weight = self.lm_head.weight
    device_type = h.device.type
    # Under autocast the head runs in the autocast dtype, as the model's own lm_head would.
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
    if hasattr(weight, "placements"):
        from services.common.tensors.vocab_parallel import vocab_parallel_logprobs

        return vocab_parallel_logprobs(h.to(dtype), weight, targets, temperature)
    return head_logprobs(h.to(dtype), weight.to(dtype), targets, temperature)


def enable_fused_head(model: nn.Module, key: str = "actor.fused_logprobs") -> None:
    """Gives `model` the forward above (an instance attribute: FQNs, state dicts and the HF class stay); `key`
    names the setting in the error when it cannot."""
    reason = supports_fused_head(model)
    if reason is not None:
        raise ValueError(f"{key}: {reason}")
    if getattr(model, "_plain_forward", None) is None:
        model._plain_forward = model.forward
        model.forward = types.MethodType(_forward, model)


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device`; to CUDA from pinned memory without a host sync (a pageable copy waits
    for every kernel queued before it)."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def sequence_logprobs(model: nn.Module, prompts, responses, *, pad_id: int, device: torch.device,
                      temperature: float = 1.0, packed: bool = False, fused: bool = False):
    """(logp [B, R], mask [B, R], entropy [B, R]) of the response tokens, padded entries 0; with gradients
    under grad mode. The one log-prob function of the actor, DPO, ComputeLogProbs and the reference.

    `packed`: one packed row per micro-batch (the model went through packing.enable_packing), else right
    padding. `fused`: through the fused head (the inner model went through enable_fused_head): no fp32
    [tokens, vocab] tensor; else the model's own logits at the response positions (the baseline path).
    `model` is the module to call (a DDP wrapper, an FSDP root or the model itself).
    """
    from services.common.tensors.packing import token_layout

    lay = token_layout(prompts, responses, pad_id=pad_id, device=device, packed=packed)
    # Right padding under the causal mask: no attention mask needed (see modeling.response_logprobs).
    if fused:
        logp, ent = model(input_ids=lay.input_ids, attention_mask=None, logprob_index=(lay.src, lay.targets),
                          temperature=temperature, **lay.model_kwargs)
    else:
        logits = model(input_ids=lay.input_ids, use_cache=False, **lay.model_kwargs).logits
        logp, ent, _ = rows_fwd(logits.reshape(-1, logits.shape[-1]).index_select(0, lay.src), lay.targets,
                                temperature)
    B, R = lay.mask.shape
    # index_copy: differentiable scatter of the N real tokens into [B * R] (padding stays 0).
    out_logp = torch.zeros(B * R, dtype=logp.dtype, device=logp.device).index_copy(0, lay.dst, logp)
    out_ent = torch.zeros(B * R, dtype=ent.dtype, device=ent.device).index_copy(0, lay.dst, ent)
    return out_logp.view(B, R), lay.mask, out_ent.view(B, R)


def fused_response_logprobs(model: nn.Module, prompts, responses, *, pad_id: int, device: torch.device,
                            temperature: float = 1.0, packed: bool = False):
    """sequence_logprobs through the fused head."""
    return sequence_logprobs(model, prompts, responses, pad_id=pad_id, device=device, temperature=temperature,
                             packed=packed, fused=True)
