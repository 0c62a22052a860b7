"""Remove padding: a micro-batch's sequences run as one packed row, attention confined to each sequence.

RL batches have a long tail of lengths; padding every row to the longest one computes mostly padding.
Here the sequences of a micro-batch are laid end to end in one row [1, T] (T = the sum of their lengths),
position ids restart at 0 for each sequence (so rotary embeddings see what they see unpacked), and the
model's attention runs through `packed_attention`, registered with transformers' AttentionInterface:

  CUDA   torch's variable-length flash attention (torch.nn.attention.varlen.varlen_attn) over the
         cumulative sequence lengths: no [T, T] mask, no work across sequences (bf16 / fp16);
         (in the autocast dtype under autocast, as SDPA runs there; see varlen_dtype);
  else   SDPA's causal kernel once per sequence (exactly the padded path's math on each): CPU, fp32 on CUDA
         without autocast.

Without packing arguments (the padded path, pipeline stages, a critic given a padding mask) the function
is transformers' own SDPA with the causal mask, so one model serves both layouts. Log-probs, entropies and
values come out as the padded path's (fp32 CPU within 1e-5: tests/unit/test_packing.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
import torch
from torch import nn

PACKED_ATTENTION = "meshrl_packed"

try:
    import inspect

    from torch.nn.attention.varlen import varlen_attn
    # Its keywords changed across torch releases: causality as is_causal or a (-1, 0) window; GQA or not.
    _VARLEN_KEYS = set(inspect.signature(varlen_attn).parameters)
except ImportError:  # older torch: the per-sequence path everywhere
    varlen_attn, _VARLEN_KEYS = None, set()


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: "PackedSeqs", scale: float | None):
    """Causal varlen flash attention of q [T, Hq, D], k / v [T, Hkv, D] -> [T, Hq, D]."""
    kwargs: dict = {"scale": scale}
    if "window_size" in _VARLEN_KEYS:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in _VARLEN_KEYS:
            kwargs["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return varlen_attn(q, k, v, packed.cu_seqlens, packed.cu_seqlens, packed.max_len, packed.max_len, **kwargs)


@dataclass(frozen=True)
class PackedSeqs:
    """Where each sequence of a packed row lies: cumulative lengths [S + 1] (int32, on the device), the longest
    sequence, and the same bounds on the host for the per-sequence path (CPU only: on CUDA compiled blocks would
    specialise on every tuple, so the rare fp32 fallback reads them from the device instead)."""

    cu_seqlens: torch.Tensor
    max_len: int
    bounds: tuple[int, ...] | None = None


def varlen_dtype(query: torch.Tensor) -> torch.dtype | None:
    """The half dtype the varlen kernel runs in for `query`, or None when it cannot (not CUDA, no varlen in this
    torch, fp32 compute). Under autocast that is the autocast dtype, as SDPA casts to it there: with fp32 master
    weights the residual stream is fp32 and rotary embeddings promote q and k to fp32 (v stays half), so the
    query's own dtype would send every layer to the per-sequence fallback, a host sync and one kernel per
    sequence (what made packed rows slower than padded ones on the GPU)."""
    if not query.is_cuda or varlen_attn is None:
        return None
    if torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return query.dtype if query.dtype in (torch.float16, torch.bfloat16) else None


def packed_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, *, packed: PackedSeqs | None = None, **kwargs):
    """A transformers attention function: query [1, Hq, T, D], key / value [1, Hkv, T, D] -> ([1, T, Hq, D],
    None). Causal within each sequence of `packed`; transformers' SDPA (causal) without it."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if packed is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    gqa = query.shape[1] != key.shape[1]
    dtype = varlen_dtype(query)
    if dtype is not None:
        q, k, v = (x[0].transpose(0, 1).to(dtype).contiguous() for x in (query, key, value))   # [T, H, D]
        return _varlen(q, k, v, packed, scaling).unsqueeze(0), None
    parts = []
    bounds = packed.bounds if packed.bounds is not None else tuple(packed.cu_seqlens.tolist())
    for start, end in zip(bounds[:-1], bounds[1:]):
        q, k, v = (x[:, :, start:end] for x in (query, key, value))
        parts.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scaling, is_causal=True,
                                                                      enable_gqa=gqa))
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    # Not registered as a mask function on purpose: transformers then builds no mask at all for this
    # implementation (the causal mask is the kernel's), and never scans position ids for packing.
    AttentionInterface.register(PACKED_ATTENTION, packed_attention)


def supports_packing(model: nn.Module) -> str | None:
    """Why `model` cannot run packed rows (None when it can): its attention must go through transformers'
    AttentionInterface with SDPA or flash attention, and every layer must attend to the full causal past."""
    config = getattr(model, "config", None)
    attn = getattr(config, "_attn_implementation", None)
    if attn not in ("sdpa", "flash_attention_2", "flash_attention_3", PACKED_ATTENTION):
        return f"attention implementation {attn!r} (needs sdpa or flash attention)"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    if not hasattr(model, "set_attn_implementation"):
        return "not a transformers model"
    return None


def enable_packing(model: nn.Module, key: str) -> None:
    """Switches `model` (a transformers model, before any wrapping) to packed_attention; `key` names the
    setting in the error when it cannot."""
    reason = supports_packing(model)
    if reason is not None:
        raise ValueError(f"{key}: cannot pack sequences for this model: {reason}")
    _register()
    model.set_attn_implementation(PACKED_ATTENTION)


class TokenLayout(NamedTuple):
    """One micro-batch's tokens, padded [B, L] or packed [1, T], and its N response tokens: src [N] (the flat
    position of the hidden state that predicts each), targets [N], dst [N] (its place in [B * R]), mask [B, R].
    `model_kwargs` go to the model's forward (position ids and PackedSeqs when packed)."""

    input_ids: torch.Tensor
    model_kwargs: dict
    src: torch.Tensor
    dst: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor


def _to(x: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(x)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def packs(total: np.ndarray, packed: bool) -> bool:
    """Whether rows of these total lengths run as one packed row. Rows of one length have no padding to remove: they
    run as [B, L], where the padded path's attention kernel (cuDNN's on Hopper, faster than varlen flash attention)
    applies. Same values either way."""
    return packed and len(total) > 1 and bool((total != total[0]).any())


def token_rows(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *, packed: bool) -> np.ndarray:
    """The row of each token of token_layout's input_ids, flattened (padding belongs to its row): what a forward
    that treats rows differently (services/trainer/model/lora_mixed.py) indexes by."""
    total = np.fromiter((len(p) + len(r) for p, r in zip(prompts, responses)), np.int64, len(prompts))
    rows = np.arange(len(total))
    return np.repeat(rows, total) if packs(total, packed) else np.repeat(rows, int(total.max()))


def token_layout(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *, pad_id: int,
                 device: torch.device, packed: bool) -> TokenLayout:
    """The TokenLayout of prompts + responses, built on the host with numpy and copied without a sync; `packed`
    lays out one packed row, unless every sequence has the same length (then [B, L] holds no padding)."""
    B = len(prompts)
    plen = np.fromiter((len(p) for p in prompts), np.int64, B)
    rlen = np.fromiter((len(r) for r in responses), np.int64, B)
    total = plen + rlen
    R = int(rlen.max())
    packed = packs(total, packed)
    if packed:
        starts = np.concatenate([[0], np.cumsum(total)])                                # [B + 1]
        ids = np.concatenate([np.concatenate([p, r]) for p, r in zip(prompts, responses)]).astype(np.int64)
        positions = np.arange(int(starts[-1])) - np.repeat(starts[:-1], total)
        input_ids, row_start = ids.reshape(1, -1), starts[:-1]
    else:
        L = int(total.max())
        input_ids = np.full((B, L), pad_id, dtype=np.int64)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            input_ids[i, :len(p)] = p
            input_ids[i, len(p):len(p) + len(r)] = r
        row_start = np.arange(B) * L
    row = np.repeat(np.arange(B), rlen)
    t = np.arange(int(rlen.sum())) - np.repeat(np.cumsum(rlen) - rlen, rlen)        # index within the response
    src = np.repeat(row_start + plen - 1, rlen) + t
    targets = input_ids.reshape(-1)[src + 1]
    dst = row * R + t
    mask = np.zeros(B * R, dtype=bool)
    mask[dst] = True
    kwargs: dict = {}
    if packed:
        kwargs = {"position_ids": _to(positions.reshape(1, -1), device),
                  "packed": PackedSeqs(_to(starts.astype(np.int32), device), int(total.max()),
                                       tuple(starts.tolist()) if device.type == "cpu" or varlen_attn is None
                                       else None)}
    return TokenLayout(_to(input_ids, device), kwargs, *(_to(x, device) for x in (src, dst, targets)),
                       _to(mask.reshape(B, R), device))


def pack_by_token_sum(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Groups indices into packed micro-batches whose total length stays within `budget` (a longer sequence
    goes alone): first fit, longest first, so the micro-batches come out full and few."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        j = next((j for j, r in enumerate(room) if r >= n), None)
        if j is None:
            bins.append([i])
            room.append(budget - n)
        else:
            bins[j].append(i)
            room[j] -= n
    return bins
