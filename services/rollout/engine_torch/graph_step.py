"""The decode step the CUDA-graph decoder (cuda_decode.py) captures: its static buffers and the step itself.

One step samples the next token of every row from the last logits (the fused Triton sampler, or torch ops for
top-p), records its raw fp32 log-prob (and the top-logprobs when asked), marks rows that hit eos or their budget,
then runs the model on that token against the static KV cache: the model's own modules (embedding, RMSNorms,
projections, MLPs, rotary embedding), attention replaced by the query of one token against every cache slot,
slots outside [pad, current] masked (decode_attention.py's kernel, or torch ops). No host sync anywhere, so the
whole step is one graph; the host side (buckets, capture, replay, prefill, stop strings) is cuda_decode.py.

The layers (fused q/k/v and gate/up projections, LoRA by group, the compiled layer body) are decode_layers.py's
DecodeLayers, shared with the paged KV cache's step; this step gives them its KV write and attention (_attend).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from services.rollout.engine_torch import decode_attention, fused_sample
from services.rollout.engine_torch.decode_layers import DecodeLayers
from services.rollout.engine_torch.sampling import top_p_filter

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")


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


def capture(graph: "torch.cuda.CUDAGraph", pool) -> "torch.cuda.graph":
    """torch.cuda.graph in thread-local capture mode. The default (global) mode makes any unsafe CUDA call from any
    thread of the process (a cudaMalloc, a synchronize) fail the capture: a process that also trains (an in-process
    mesh, services/local.py: several runs on one GPU in bench/many_runs.py) failed captures whenever its trainer
    thread allocated.
    Captures here run on the capturing thread's own stream, so other threads' work is not recorded into them."""
    return torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local")


@dataclass
class State:
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


class GraphStep(DecodeLayers):
    """One decode step for one token per row over a bucket's static buffers, graph-safe (no host syncs)."""

    def __init__(self, model, *, eos_ids: Sequence[int], compile: bool, fused_sampler: bool,
                 triton_attention: bool):
        super().__init__(model, compile=compile)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.fused_sampler = fused_sampler and fused_sample.available(self.device)
        hd = self.head_dim
        self.triton_attention = (triton_attention and decode_attention.available(self.device) and hd >= 16
                                 and hd & (hd - 1) == 0)
        self.vocab_size = int(model.config.vocab_size)
        self._eos = torch.tensor(sorted(eos_ids) or [-1], dtype=torch.long, device=self.device)

    def _new_state(self, B: int, S: int) -> State:
        """The static buffers of a (batch, length) bucket."""
        d, kw = self.device, dict(device=self.device)
        n_layers = len(self.model.model.layers)
        shape = (B, self.num_kv, S, self.head_dim)
        return State(
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

    def _step(self, st: State, mode: tuple[str, bool]) -> None:
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
    def _torch_sample(st: State, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
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

    def _forward(self, st: State, tok: torch.Tensor) -> torch.Tensor:
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
        mask = self._step_mask(x)
        for i, layer in enumerate(m.layers):
            x = self._layer_fn(layer, x, cos, sin, self._proj[i], mask, bias, st.k[i], st.v[i], st.slot, st.pad)
        x = m.norm(x)[:, 0]
        head = self.model.lm_head
        if head.bias is None and x.dtype == st.logits.dtype:
            torch.mm(x, head.weight.t(), out=st.logits)                           # no [B, V] temporary
        else:
            st.logits.copy_(head(x))

    def _layer(self, layer, x, cos, sin, proj: tuple, mask: torch.Tensor | None, bias: torch.Tensor | None,
               kc: torch.Tensor, vc: torch.Tensor, slot: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        """One decoder layer (decode_layers.py) against the layer's static cache kc, vc."""
        return self._layer_body(layer, x, cos, sin, proj, mask, (bias, kc, vc, slot, pad))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                kc: torch.Tensor, vc: torch.Tensor, slot: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        """Writes k/v at `slot` of the layer's cache kc, vc [B, KV, S, hd], then attends over slots [pad, slot]: the
        Triton kernel (bias None), or torch ops with bias [B, 1, 1, S] masking the rest."""
        B, H, KV, hd = q.shape[0], self.num_heads, self.num_kv, self.head_dim
        kc.index_copy_(2, slot, k)
        vc.index_copy_(2, slot, v)
        if bias is None:                                                         # slots [pad, slot] only
            return decode_attention.decode_attention(q[:, :, 0], kc, vc, pad, slot, self.scaling).reshape(B, 1, H * hd)
        # Grouped query heads against their kv head: [B, KV, G, hd] x [B, KV, hd, S].
        scores = torch.matmul(q.reshape(B, KV, H // KV, hd), kc.transpose(-1, -2)).float()
        probs = torch.softmax(scores * self.scaling + bias, dim=-1).to(q.dtype)
        return torch.matmul(probs, vc).reshape(B, 1, H * hd)
