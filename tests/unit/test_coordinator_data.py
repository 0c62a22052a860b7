"""Datasets: verl's Parquet row schema, plain rows, seeded epochs and a resumable position."""

import json
from pathlib import Path

import pytest

from coordinator.recipe.data import PromptStream, load_problems, read_rows, row_to_problem
from services.common.rpc.pools import split_round_robin

ARITH_MODEL = str(Path(__file__).resolve().parents[2] / "examples" / "arith" / "model")


def test_plain_prompt_answer_rows_are_read(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "1+2=", "answer": "3"}\n\n{"prompt": "2+2=", "answer": "4", "data_source": "x"}\n')
    problems = load_problems([str(path)])
    assert [(p.prompt, p.ground_truth, p.data_source) for p in problems] == [("1+2=", "3", ""), ("2+2=", "4", "x")]


def test_verl_rows_with_chat_messages_use_the_chat_template():
    from services.common.tensors.modeling import load_tokenizer

    row = {"data_source": "gsm8k", "prompt": [{"role": "user", "content": "1+1="}], "ability": "math",
           "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"index": 7}}
    p = row_to_problem(row, 0, prompt_key="prompt", answer_key="answer", tokenizer=load_tokenizer(ARITH_MODEL))
    assert (p.prompt, p.ground_truth, p.data_source, p.id) == ("<s>1+1=", "2", "gsm8k", "7")
    assert (p.ability, p.reward_style, p.extra_info) == ("math", "rule", {"index": 7})


def test_malformed_jsonl_names_the_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "answer": "b"}\n{"prompt": oops}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl' line 2: invalid JSON"):
        read_rows(str(path))


def test_missing_prompt_key_is_named(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    with pytest.raises(ValueError, match="missing key 'prompt' \\(data.prompt_key\\)"):
        load_problems([str(path)])


def test_prompt_stream_is_seeded_and_resumes_at_its_position():
    from coordinator.recipe.data import Problem

    problems = [Problem(str(i), f"{i}+0=", str(i), "") for i in range(10)]
    a = PromptStream(problems, seed=3)
    first = a.take(4)
    a.advance(4)
    second = a.take(8)            # crosses into epoch 1
    resumed = PromptStream(problems, seed=3, position=4)
    assert resumed.take(8) == second
    assert PromptStream(problems, seed=3).take(4) == first
    assert PromptStream(problems, seed=4).take(10) != PromptStream(problems, seed=3).take(10)
    # each epoch is a permutation
    assert sorted(p.id for p in a.take(10)[6:] + a.take(6)) != []
    assert sorted(p.id for p in PromptStream(problems, seed=3, position=10).take(10)) == sorted(str(i)
                                                                                             for i in range(10))


def test_split_round_robin_keeps_contiguous_groups_and_loses_nothing():
    chunks = split_round_robin(list(range(7)), 3)
    assert chunks == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_round_robin([1], 3) == [[1]]


def test_verl_parquet_rows_load_unchanged(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from services.common.tensors.modeling import load_tokenizer

    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{i}+1="}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)}, "extra_info": {"split": "train", "index": i}}
            for i in range(3)]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    problems = load_problems([str(path)], tokenizer=load_tokenizer(ARITH_MODEL))
    assert [(p.prompt, p.ground_truth, p.data_source, p.id) for p in problems] == [
        ("<s>0+1=", "1", "openai/gsm8k", "0"), ("<s>1+1=", "2", "openai/gsm8k", "1"),
        ("<s>2+1=", "3", "openai/gsm8k", "2")]
    assert problems[2].extra_info == {"split": "train", "index": 2}
