"""Tiny random Qwen2 models and samples for trainer tests (CPU, seconds)."""

from __future__ import annotations

from pathlib import Path

import torch

from services.trainer.types import TrainSample


def make_tiny_model(path: str | Path, *, seed: int = 0, vocab_size: int = 32, num_hidden_layers: int = 2) -> str:
    """Saves a random tiny Qwen2 (tied embeddings, pad/bos/eos = 0/1/2) to `path` and returns it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=num_hidden_layers,
                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                      max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2)
    torch.manual_seed(seed)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return str(path)


def random_samples(num: int, *, vocab_size: int = 32, seed: int = 0, max_prompt: int = 6,
                   max_response: int = 8) -> list[TrainSample]:
    """Samples of random lengths with random advantages and old log-probs filled with zeros."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        p = int(torch.randint(1, max_prompt + 1, (1,), generator=g))
        r = int(torch.randint(1, max_response + 1, (1,), generator=g))
        out.append(TrainSample(prompt_ids=torch.randint(3, vocab_size, (p,), generator=g).tolist(),
                               response_ids=torch.randint(3, vocab_size, (r,), generator=g).tolist(),
                               advantages=torch.randn(r, generator=g).tolist(), old_logprobs=[0.0] * r,
                               ref_logprobs=[]))
    return out


def sequences_pb(samples):
    """A LogProbsRequest over samples' prompt/response ids (ids s0, s1, ...), as the trainer tests send it."""
    from meshrl.v1 import common_pb2

    return common_pb2.LogProbsRequest(sequences=[
        common_pb2.TokenSequence(id=f"s{i}", prompt_ids=s.prompt_ids, response_ids=s.response_ids)
        for i, s in enumerate(samples)], temperature=1.0)
