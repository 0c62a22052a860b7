"""profile_model: per-layer parameters and FLOPs of a Hugging Face causal LM, and a balanced PP stage split.

Reads config.json only (no weights), so it profiles a 70B model as fast as a tiny one.
`meshrl profile-model MODEL_PATH --pp-size 4 --seq-len 2048` prints it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerProfile:
    name: str
    params: int
    # Forward FLOPs per token at the given sequence length (training costs about 3x).
    flops_per_token: float


def layer_profiles(config, seq_len: int) -> list[LayerProfile]:
    """Embedding, every decoder layer, and the head (final norm + LM head) of a Llama/Qwen2-style model."""
    h = config.hidden_size
    inter = config.intermediate_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    vocab = config.vocab_size
    qkv_bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
    q, kv = heads * head_dim, kv_heads * head_dim
    attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if qkv_bias else 0)
    mlp = 3 * h * inter
    layer_params = attn + mlp + 2 * h                                   # + two RMSNorms
    # Matmuls: 2 FLOPs per weight per token; attention scores and weighted sum: 2 * 2 * seq * q per token
    # (causal masking halves the useful work; kernels usually compute it all, so it is counted whole).
    layer_flops = 2 * (attn + mlp) + 4 * seq_len * q
    tied = bool(getattr(config, "tie_word_embeddings", False))
    out = [LayerProfile("embed_tokens", vocab * h, 0.0)]
    out += [LayerProfile(f"layers.{i}", layer_params, float(layer_flops)) for i in range(config.num_hidden_layers)]
    out.append(LayerProfile("norm+lm_head", h + (0 if tied else vocab * h), float(2 * vocab * h)))
    return out


def balanced_split(costs: list[float], num_stages: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges over `costs` minimising the largest stage cost (exact DP)."""
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"pp_size: must be between 1 and the number of layers ({n}), got {num_stages}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: minimal max-stage cost splitting the first i items into k stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    ranges, i = [], n
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        ranges.append((j, i))
        i = j
    return ranges[::-1]


def profile_model(path_or_config, *, seq_len: int = 2048, pp_size: int = 1) -> dict:
    """Per-layer parameters and FLOPs, totals, and the PP stage split that balances training FLOPs."""
    config = path_or_config
    if isinstance(path_or_config, str):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path_or_config, local_files_only=True)
    layers = layer_profiles(config, seq_len)
    # Stage cost: training FLOPs, with the embedding lookup given a token weight so it is placed.
    costs = [max(l.flops_per_token, 1.0) for l in layers]
    split = balanced_split(costs, pp_size)
    total_flops = sum(l.flops_per_token for l in layers)
    stages = [{"stage": s, "layers": [layers[i].name for i in range(a, b)],
               "params": sum(layers[i].params for i in range(a, b)),
               "flops_share": sum(layers[i].flops_per_token for i in range(a, b)) / total_flops}
              for s, (a, b) in enumerate(split)]
    return {"model_type": config.model_type, "seq_len": seq_len,
            "layers": [l.__dict__ for l in layers],
            "total_params": sum(l.params for l in layers),
            "train_flops_per_token": 3 * total_flops,
            "stages": stages,
            "max_stage_share": max(s["flops_share"] for s in stages)}
