"""Fast checks of the arith example: split hygiene, answers, determinism, tokenizer and shipped model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The example lives outside any installed package; make `examples.arith` importable
# however pytest is invoked (plain `pytest` does not put the repo root on sys.path).
REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from examples.arith import task  # noqa: E402

MODEL_DIR = REPO / "examples" / "arith" / "model"
DATA_DIR = REPO / "examples" / "arith" / "data"


def _key(row: dict) -> str:
    return row["prompt"]


@pytest.mark.parametrize("ops", [("+",), ("+", "-")])
def test_splits_disjoint(ops):
    train = {_key(r) for r in task.make_problems(100_000, seed=0, split="train", ops=ops)}
    held = {_key(r) for r in task.make_problems(100_000, seed=0, split="heldout", ops=ops)}
    assert train and held and not (train & held)
    # Together they cover the whole problem space: the split drops nothing.
    n_sub = 100 * 101 // 2 if "-" in ops else 0
    assert len(train) + len(held) == 100 * 100 + n_sub
    # Held-out is roughly the intended 10%.
    assert 0.08 < len(held) / (len(train) + len(held)) < 0.12


def test_split_independent_of_seed():
    # Disjointness must hold across seeds, not just for one draw.
    held = {_key(r) for s in range(3) for r in task.make_problems(300, seed=s, split="heldout")}
    train = {_key(r) for s in range(3) for r in task.make_problems(3000, seed=s, split="train")}
    assert not (held & train)


def test_shipped_jsonl_disjoint_and_correct():
    train = task.read_jsonl(DATA_DIR / "train.jsonl")
    held = task.read_jsonl(DATA_DIR / "heldout.jsonl")
    assert len(train) == 5000 and len(held) == 200
    assert not ({_key(r) for r in train} & {_key(r) for r in held})
    for r in train[:500] + held:
        assert r["answer"] == task.answer_of(r["prompt"])
        assert r["data_source"] == "arith"


def test_answers_correct():
    rows = task.make_problems(500, seed=1, split="train", ops=("+", "-"))
    for r in rows:
        a, rest = r["prompt"].replace("-", "+").split("+")
        b = rest.rstrip("=")
        assert 0 <= int(a) <= 99 and 0 <= int(b) <= 99
        expected = int(a) + int(b) if "+" in r["prompt"] else int(a) - int(b)
        assert expected >= 0 and r["answer"] == str(expected)
    assert task.answer_of("37+45=") == "82"
    assert task.answer_of("52-17=") == "35"
    with pytest.raises(ValueError):
        task.answer_of("hello")


def test_no_carry_answer():
    assert task.no_carry_answer("37+45=") == "72"
    assert task.no_carry_answer("85+37=") == "12"
    assert task.no_carry_answer("12+13=") == "25" == task.answer_of("12+13=")
    assert task.has_carry("5+95=") and not task.has_carry("12+13=")


def test_same_seed_same_problems():
    assert task.make_problems(50, seed=7, split="train") == task.make_problems(50, seed=7, split="train")
    assert task.make_problems(50, seed=7, split="train") != task.make_problems(50, seed=8, split="train")
    assert len({_key(r) for r in task.make_problems(200, seed=0, split="heldout")}) == 200  # no duplicates


def test_reward_exact_match():
    assert task.reward("82", "82") == 1.0
    assert task.reward(" 82 ", "82") == 1.0
    assert task.reward("820", "82") == 0.0


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)


def test_tokenizer_roundtrip_and_bos(tokenizer):
    assert tokenizer.pad_token_id == 0
    assert tokenizer.bos_token_id is not None and tokenizer.eos_token_id is not None
    for text in ["37+45=", "37+45=82", "0+0=0", "12 - 3 = 9 ", "abc xyz", "  "]:
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == tokenizer.bos_token_id
        assert len(ids) == len(text) + 1  # one token per character
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    ids = tokenizer("82", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id, 0, 0]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "82"


def test_all_loaders_agree(tokenizer):
    # AutoTokenizer rebuilds a qwen2 checkpoint's tokenizer as Qwen2Tokenizer; the
    # saved pipeline and a generic loader must produce the same ids or SFT-time and
    # rollout-time tokenization could silently diverge.
    from transformers import TokenizersBackend

    from examples.arith.sft import build_tokenizer

    generic = TokenizersBackend.from_pretrained(MODEL_DIR, local_files_only=True)
    built = build_tokenizer()
    for text in ["37+45=", "99+99=198", "12 - 3 = 9 ", "abc xyz"]:
        ids = tokenizer(text)["input_ids"]
        assert generic(text)["input_ids"] == ids == built(text)["input_ids"]


def test_chat_template_matches_plain_encoding(tokenizer):
    msgs = [{"role": "user", "content": "37+45="}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == tokenizer.bos_token + "37+45="
    ids = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert list(ids) == tokenizer("37+45=")["input_ids"]


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MODEL_DIR, local_files_only=True).eval()


def test_model_loads_offline_and_is_tiny(model, tokenizer):
    assert model.config.model_type == "qwen2"
    assert sum(p.numel() for p in model.parameters()) <= 5_000_000
    assert model.config.vocab_size == len(tokenizer)
    for cfg in (model.config, model.generation_config):
        assert cfg.pad_token_id == tokenizer.pad_token_id
        assert cfg.bos_token_id == tokenizer.bos_token_id
        assert cfg.eos_token_id == tokenizer.eos_token_id
    assert sum(f.stat().st_size for f in MODEL_DIR.iterdir()) < 20 * 2**20


def test_shipped_model_has_rl_headroom(model, tokenizer):
    # The GRPO demo needs a policy that is right sometimes but not always. A
    # retrain that ships a perfect (or untrained) model would silently break it.
    from examples.arith.sft import evaluate

    held = task.read_jsonl(DATA_DIR / "heldout.jsonl")
    acc = evaluate(model, tokenizer, held)
    assert 0.15 <= acc <= 0.6, acc
