"""The word-problem example: verl's Parquet schema, a disjoint split, a verl-style reward, a chat tokenizer with one bos."""

from __future__ import annotations

from pathlib import Path

from examples.wordproblems import task
from examples.wordproblems.reward import compute_score
from examples.wordproblems.sft import build_tokenizer, prompt_ids

DATA = Path(task.__file__).resolve().parent / "data"


def test_rows_carry_verls_schema_and_a_worked_answer():
    row = task.make_rows(3, seed=0, split="train")[0]
    assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert row["prompt"][0]["role"] == "user" and row["reward_model"]["style"] == "rule"
    op, a, b = task.parse_question(row["prompt"][0]["content"])
    assert row["reward_model"]["ground_truth"] == str(task.solve(op, a, b))
    assert row["extra_info"]["answer"].endswith(f"#### {row['reward_model']['ground_truth']}")
    assert {"split", "index", "answer"} <= set(row["extra_info"])


def test_train_and_heldout_never_share_a_problem():
    train = task.read_parquet(DATA / "train.parquet")
    heldout = task.read_parquet(DATA / "heldout.parquet")
    key = lambda r: task.parse_question(r["prompt"][0]["content"])  # noqa: E731
    assert (len(train), len(heldout)) == (5000, 200)
    assert not {key(r) for r in train} & {key(r) for r in heldout}


def test_compute_score_reads_the_final_answer_line_and_logs_the_worked_line():
    assert compute_score("wordproblems", "37+45=82\n#### 82", "82") == {"score": 1.0, "formatted": 1.0,
                                                                       "worked_ok": 1.0}
    assert compute_score("wordproblems", "37+45=72\n#### 72", "82")["score"] == 0.0
    assert compute_score("wordproblems", "37+45=72\n#### 72", "82")["worked_ok"] == 0.0
    assert compute_score("wordproblems", "37+45=82", "82", extra_info={"index": 1})["formatted"] == 0.0


def test_the_chat_template_gives_one_bos_and_opens_the_assistant_turn():
    tok = build_tokenizer()
    ids = prompt_ids(tok, {"prompt": [{"role": "user", "content": "Ann has 3 pens. She buys 4. How many now?"}]})
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    assert ids[-2:] == tok.convert_tokens_to_ids(["<|end|>", "<|assistant|>"])
    assert tok.eos_token == "<|end|>"  # generation stops at the end of the assistant's turn
    assert tok.decode(tok("12+3=15\n#### 15", add_special_tokens=False)["input_ids"]) == "12+3=15\n#### 15"
