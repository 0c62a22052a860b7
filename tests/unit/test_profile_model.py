"""profile_model counts parameters exactly and splits pipeline stages evenly."""

import pytest
import torch
import transformers

from services.common.tensors.profile_model import balanced_split, profile_model


def _config(**kw):
    base = dict(vocab_size=64, hidden_size=32, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=64, tie_word_embeddings=True)
    return transformers.Qwen2Config(**{**base, **kw})


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_matches_the_instantiated_model(tied):
    cfg = _config(tie_word_embeddings=tied)
    model = transformers.Qwen2ForCausalLM(cfg)
    expected = sum(p.numel() for p in model.parameters())   # tied weights are counted once
    assert profile_model(cfg, seq_len=128)["total_params"] == expected


def test_llama_without_bias_is_counted_exactly():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=4, intermediate_size=48, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    assert profile_model(cfg)["total_params"] == sum(p.numel() for p in model.parameters())


def test_balanced_split_minimises_the_largest_stage():
    assert balanced_split([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
    assert balanced_split([5, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 6)]
    assert balanced_split([1, 2, 3], 3) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError, match="pp_size"):
        balanced_split([1, 2], 3)


def test_stages_cover_every_layer_once_and_are_balanced():
    prof = profile_model(_config(num_hidden_layers=8), seq_len=256, pp_size=4)
    names = [n for s in prof["stages"] for n in s["layers"]]
    assert names == [l["name"] for l in prof["layers"]]
    assert prof["max_stage_share"] < 0.4
