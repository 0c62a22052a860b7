"""The decode step the CUDA-graph decoder (cuda_decode.py) captures: its static buffers and the step itself.

One step samples the next token of every row from the last logits (the fused Triton sampler, or torch ops for
top-p), records its raw fp32 log-prob (and the top-logprobs when asked), marks rows that hit eos or their budget,
then runs the model on that token against the static KV cache: the model's own modules (embedding, RMSNorms,
projections, MLPs, rotary embedding), attention replaced by the query of one token against every cache slot,
slots outside [pad, current] masked (decode_attention.py's kernel, or torch ops). No host sync anywhere, so the
whole step is one graph; the host side (buckets, capture, replay, prefill, stop strings) is cuda_decode.py.

With LoRA adapters served (lora.py), the step builds the rows' slot mask once and applies each layer's adapters by
group: q/k/v's shrink rows (A) stacked under the fused q/k/v weight copy, so one GEMM gives the base output and the
shrink, then one block-diagonal expand GEMM added to q|k|v before the split; gate/up with one shrink and one expand
GEMM (their base GEMMs stay two: a fused copy of gate/up would be GiBs), o and down one group each. The
projections' base outputs come from their weights (F.linear), so the layers' own per-layer deltas never run here.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F

from services.rollout.engine_torch import decode_attention, fused_sample
from services.rollout.engine_torch.sampling import top_p_filter
from services.rollout.engine_torch.lora import (GATE_UP, QKV, LoraLinear, bank_of, grouped_delta, lora_linear,
                                                masked_expand)

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


class GraphStep:
    """One decode step for one token per row over a bucket's static buffers, graph-safe (no host syncs)."""

    def __init__(self, model, *, eos_ids: Sequence[int], compile: bool, fused_sampler: bool,
                 triton_attention: bool):
        self.model = model
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.fused_sampler = fused_sampler and fused_sample.available(self.device)
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
        # torch.compile fuses the ~40 small kernels of each layer (norms, rope, softmax, SiLU, casts) into a few;
        # in a graph every launch still costs a few microseconds, and at decode sizes launches are the time.
        # One layer is compiled and reused by all (regional compilation: seconds, not minutes); default mode,
        # no inductor cudagraphs: the decoder captures the whole step. After the first change of bucket the
        # sizes are compiled dynamic.
        self._layer_fn = torch.compile(self._layer, fullgraph=True) if compile else self._layer
        # q, k and v projections as one GEMM per layer (three small ones were ~10% of a step at batch 512):
        # concatenated copies of the weights, refreshed from the model at every decode call (~50 MB at 0.5B),
        # so weight updates of any kind are seen. Only where all three have a bias or none has.
        # LoRA adapters served on this model (rollout.enable_lora): each row's slot is in adapters.rows. With them,
        # the fused copy holds the q/k/v group's A under the base rows (its tail is the bank's A itself, so loads land
        # there): the same GEMM gives the shrink.
        self.adapters = bank_of(model)
        self._qkv = self._qkv_buffers()
        self._lora = self._lora_groups()

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

    def _qkv_buffers(self) -> list[tuple[torch.Tensor, torch.Tensor | None]] | None:
        attn = [layer.self_attn for layer in self.model.model.layers]
        has_bias = {p.bias is not None for a in attn for p in (a.q_proj, a.k_proj, a.v_proj)}
        if len(has_bias) != 1:
            return None
        out = []
        for a in attn:
            rows = sum(p.weight.shape[0] for p in (a.q_proj, a.k_proj, a.v_proj))
            group = self.adapters.group(a, QKV) if self.adapters is not None else None
            w = group.under_base_rows(rows) if group is not None else torch.empty(
                (rows, a.q_proj.weight.shape[1]), dtype=a.q_proj.weight.dtype, device=a.q_proj.weight.device)
            # zeros: the rows of A take no bias
            b = torch.zeros(w.shape[0], dtype=w.dtype, device=w.device) if a.q_proj.bias is not None else None
            out.append((w, b))
        return out

    def _lora_groups(self) -> list[tuple] | None:
        """Per layer, the adapter groups the step applies: (q/k/v, o, gate/up, down), each the bank's (A, B) or None;
        None without a bank."""
        bank = self.adapters
        if bank is None:
            return None
        out = []
        for i, layer in enumerate(self.model.model.layers):
            a, mlp = layer.self_attn, layer.mlp
            groups = (bank.group(a, QKV), bank.group(a, ("o_proj",)), bank.group(mlp, GATE_UP),
                      bank.group(mlp, ("down_proj",)))
            covered = sum(g.A.shape[0] for g in groups if g is not None) // bank.width
            adapted = sum(isinstance(m, LoraLinear) for m in layer.modules())
            if covered != adapted:      # an adapted layer the step would skip: refuse rather than drop its delta
                raise ValueError(f"rollout.lora_target_modules: layer {i} adapts {adapted} linear layers, the CUDA-graph "
                                 f"step applies {covered} (q/k/v/o/gate/up/down only); set rollout.cuda_graphs: false")
            out.append(tuple(None if g is None else (g.A, g.B) for g in groups))
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
            rows = sum(p.weight.shape[0] for p in (a.q_proj, a.k_proj, a.v_proj))
            torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], out=w[:rows])   # A's rows below stay
            if b is not None:
                torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias], out=b[:rows])

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
        # The rows' adapter mask, once per step for every group of every layer (None: base rows only).
        mask = None if self._lora is None or self.adapters.base_only(x) else self.adapters.step_mask(x.shape[0])
        for i, layer in enumerate(m.layers):
            wqkv, bqkv = self._qkv[i] if self._qkv is not None else (None, None)
            lora = self._lora[i] if mask is not None else None
            x = self._layer_fn(layer, x, cos, sin, bias, st.k[i], st.v[i], st.slot, st.pad, wqkv, bqkv, lora, mask)
        x = m.norm(x)[:, 0]
        head = self.model.lm_head
        if head.bias is None and x.dtype == st.logits.dtype:
            torch.mm(x, head.weight.t(), out=st.logits)                           # no [B, V] temporary
        else:
            st.logits.copy_(head(x))

    def _layer(self, layer, x, cos, sin, bias, kc: torch.Tensor, vc: torch.Tensor, slot: torch.Tensor,
               pad: torch.Tensor, wqkv: torch.Tensor | None = None, bqkv: torch.Tensor | None = None,
               lora: tuple | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """One decoder layer for one token per row; writes its k/v at `slot` of the layer's cache. lora: the layer's
        adapter groups (q/k/v, o, gate/up, down: (A, B) or None each), mask: the step's row mask."""
        B, H, KV, hd = x.shape[0], self.num_heads, self.num_kv, self.head_dim
        a = layer.self_attn
        lqkv, lo, lgu, ldown = lora if lora is not None else (None, None, None, None)
        h = layer.input_layernorm(x)
        sizes = [H * hd, KV * hd, KV * hd]
        if wqkv is not None:
            # One GEMM: the base q|k|v, then (with adapters) the group's shrink x A^T; the group's expand of it, lined
            # up with q|k|v, on top.
            y = F.linear(h, wqkv, bqkv)
            qkv = y[..., :sum(sizes)]
            q, k, v = (qkv if lqkv is None else qkv + masked_expand(y[..., sum(sizes):], lqkv[1], mask)).split(
                sizes, dim=-1)
        else:
            q, k, v = (F.linear(h, p.weight, p.bias) for p in (a.q_proj, a.k_proj, a.v_proj))
            if lqkv is not None:
                dq, dk, dv = grouped_delta(h, *lqkv, mask).split(sizes, dim=-1)
                q, k, v = q + dq, k + dk, v + dv
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
        x = x + lora_linear(o, a.o_proj, lo, mask)
        return x + self._mlp(layer.mlp, layer.post_attention_layernorm(x), lgu, ldown, mask)

    @staticmethod
    def _mlp(mlp, h: torch.Tensor, lgu: tuple | None, ldown: tuple | None, mask: torch.Tensor | None) -> torch.Tensor:
        """down(act(gate h) * up h) (Llama's and Qwen2's MLP) with its adapter groups; the module's own forward when
        none is adapted."""
        if lgu is None and ldown is None:
            return mlp(h)
        g = F.linear(h, mlp.gate_proj.weight, mlp.gate_proj.bias)
        u = F.linear(h, mlp.up_proj.weight, mlp.up_proj.bias)
        if lgu is not None:
            dg, du = grouped_delta(h, *lgu, mask).split([g.shape[-1], u.shape[-1]], dim=-1)
            g, u = g + dg, u + du
        return lora_linear(mlp.act_fn(g) * u, mlp.down_proj, ldown, mask)
