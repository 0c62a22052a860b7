"""A decoder-only model's shape, read from its folder before anything starts: config.json (Qwen2/Llama names) and
the safetensors files' JSON headers, for an exact parameter count. No torch; the memory estimate (memory.py) uses it.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a decoder-only model (Qwen2/Llama names of config.json)."""

    num_params: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of every layer for one token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each projection of one decoder block, by its module name."""
        h, kv, i = self.hidden, self.kv_heads * self.head_dim, self.intermediate
        q = self.heads * self.head_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def count_params(c: dict) -> int:
    """Parameters of a Qwen2/Llama-style model from its config (q/k/v biases as Qwen2 has them)."""
    h, layers, v = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    heads = c["num_attention_heads"]
    hd = c.get("head_dim") or h // heads
    kv = c.get("num_key_value_heads", heads) * hd
    q = heads * hd
    bias = c.get("attention_bias", c.get("model_type") == "qwen2")
    attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if bias else 0)
    mlp = 3 * h * c["intermediate_size"]
    head = 0 if c.get("tie_word_embeddings", True) else v * h
    return v * h + layers * (attn + mlp + 2 * h) + h + head


def _safetensors_params(folder: Path) -> int | None:
    """Parameters stored in the folder's safetensors files, from their JSON headers (nothing else is read)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for f in files:
        try:
            with f.open("rb") as fh:
                (size,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(size))
            total += sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
        except (OSError, struct.error, ValueError, KeyError, TypeError):
            return None            # not a readable safetensors file: the config's count instead
    return total


def model_shape(path: str) -> ModelShape:
    """The shape of the model folder at `path`; ValueError when it has no readable config.json."""
    folder = Path(path)
    try:
        c = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"model.path: cannot read {str(folder / 'config.json')!r} ({e})") from None
    c = c.get("text_config", c)
    try:
        heads = c["num_attention_heads"]
        num_params = _safetensors_params(folder) or count_params(c)
        return ModelShape(num_params=num_params, hidden=c["hidden_size"], layers=c["num_hidden_layers"],
                          heads=heads, kv_heads=c.get("num_key_value_heads", heads),
                          head_dim=c.get("head_dim") or c["hidden_size"] // heads,
                          intermediate=c["intermediate_size"], vocab=c["vocab_size"],
                          tied=c.get("tie_word_embeddings", True))
    except KeyError as e:
        raise ValueError(f"model.path: {str(folder / 'config.json')!r} has no {e.args[0]!r} (the memory estimate "
                         f"reads decoder-only configs: hidden_size, num_hidden_layers, ...)") from None
