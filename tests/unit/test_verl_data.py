"""verl datasets: Parquet rows read as is, chat prompts rendered once to token ids, every row field carried to the
reward and the sample records, overlong prompts refused or dropped, bad rows named."""

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from coordinator.recipe.config import RunConfig
from coordinator.recipe.data import Problem, load_dataset, load_problems, render_chat
from coordinator.training import phases, remote, reporting
from coordinator.training.loop import load_prompts
from services.common.config import load_config
from services.common.tensors.modeling import load_tokenizer
from services.rollout.convert import request_from_pb
from services.rollout.local_model import end_of_turn_ids

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

ARITH_MODEL = str(Path(__file__).resolve().parents[2] / "examples" / "arith" / "model")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ARITH_MODEL)


def verl_row(i: int, **overrides) -> dict:
    row = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{i}+1="}], "ability": "math",
           "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
           "extra_info": {"split": "train", "index": i, "answer": f"{i}+1={i + 1}\n#### {i + 1}"}}
    return {**row, **overrides}


def write_parquet(path: Path, rows: list[dict]) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_a_chat_prompt_is_rendered_once_to_ids_with_exactly_one_bos(tokenizer):
    text, ids = render_chat(tokenizer, [{"role": "user", "content": "37+45="}])
    assert text == "<s>37+45="
    # Rendered text tokenized again with special tokens gives [1, 1, ...]: the bug this pins down.
    assert ids == (1, 7, 11, 14, 8, 9, 16)
    assert tokenizer(text)["input_ids"][:2] == [1, 1]


def test_chat_prompts_travel_to_the_rollout_as_token_ids_and_plain_prompts_as_text(tokenizer, tmp_path):
    path = write_parquet(tmp_path / "t.parquet", [verl_row(37)])
    [chat] = load_problems([path], tokenizer=tokenizer)
    plain = Problem("p", "2+2=", "4", "")
    sent = []

    class Stub:
        async def Generate(self, request):
            sent.append(request)
            raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here"):
        asyncio.run(remote.generate(Stub(), [chat, plain], [0, 1], RunConfig().rollout.sampling()))
    batch = request_from_pb(sent[0], RunConfig().rollout)
    assert [list(p.prompt_ids) for p in batch.prompts] == [[1, 7, 11, 14, 5, 16], []]    # <s>37+1=
    assert [p.text for p in batch.prompts] == ["", "2+2="]


def test_every_verl_field_is_kept_on_the_problem(tokenizer, tmp_path):
    path = write_parquet(tmp_path / "t.parquet", [verl_row(3)])
    [p] = load_problems([path], tokenizer=tokenizer)
    assert (p.data_source, p.ability, p.reward_style, p.ground_truth, p.id) == ("openai/gsm8k", "math", "rule", "4", "3")
    assert p.extra_info == {"split": "train", "index": 3, "answer": "3+1=4\n#### 4"}


def test_reward_fn_key_picks_the_field_that_reaches_the_reward_as_data_source(tokenizer, tmp_path):
    path = write_parquet(tmp_path / "t.parquet", [verl_row(1, task="math")])
    [p] = load_problems([path], tokenizer=tokenizer, reward_fn_key="task")
    assert p.data_source == "math"


def test_a_parquet_file_without_the_prompt_column_is_refused_naming_file_and_column(tokenizer, tmp_path):
    rows = [{k: v for k, v in verl_row(1).items() if k != "prompt"}]
    path = write_parquet(tmp_path / "noprompt.parquet", rows)
    with pytest.raises(ValueError) as err:
        load_problems([path], tokenizer=tokenizer)
    assert "noprompt.parquet" in str(err.value) and "no column 'prompt'" in str(err.value)
    assert "data.prompt_key" in str(err.value)


def test_a_parquet_file_without_an_answer_column_is_refused(tokenizer, tmp_path):
    rows = [{k: v for k, v in verl_row(1).items() if k != "reward_model"}]
    path = write_parquet(tmp_path / "noanswer.parquet", rows)
    with pytest.raises(ValueError, match=r"noanswer.parquet': no column 'reward_model'"):
        load_problems([path], tokenizer=tokenizer)


def test_a_row_whose_prompt_is_not_a_message_list_is_refused_naming_file_and_row(tokenizer, tmp_path):
    rows = [verl_row(0), verl_row(1, prompt=[{"text": "1+1="}])]
    path = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(ValueError) as err:
        load_problems([path], tokenizer=tokenizer)
    assert "bad.parquet' row 1" in str(err.value) and "list of chat messages" in str(err.value)


def test_an_overlong_prompt_is_refused_naming_its_row_or_dropped_and_counted(tokenizer, tmp_path):
    long = verl_row(2, prompt=[{"role": "user", "content": "1+1=" * 5}])
    path = write_parquet(tmp_path / "t.parquet", [verl_row(1), long])
    with pytest.raises(ValueError) as err:
        load_dataset([path], tokenizer=tokenizer, max_prompt_tokens=8)
    assert str(err.value).startswith("data.max_prompt_length: ") and "row 1: the prompt is 21 tokens" in str(err.value)
    ds = load_dataset([path], tokenizer=tokenizer, max_prompt_tokens=8, filter_overlong=True)
    assert len(ds.problems) == 1 and ds.num_overlong_dropped == 1


def test_an_unknown_data_source_is_refused_before_step_one_naming_it(tokenizer, tmp_path):
    path = write_parquet(tmp_path / "t.parquet", [verl_row(1), verl_row(2, data_source="acme/riddles")])
    cfg = load_config(RunConfig, data={"data": {"train_files": [path]}})
    with pytest.raises(ValueError) as err:
        load_prompts(cfg, tokenizer, 0)
    assert "'acme/riddles'" in str(err.value) and "row 1" in str(err.value)
    # A list of its own for that data_source, or a custom function, lets it through.
    cfg = load_config(RunConfig, data={"data": {"train_files": [path]},
                                       "reward": {"by_data_source": {"acme/riddles": [{"name": "exact_match"}]}}})
    assert len(load_prompts(cfg, tokenizer, 0)[0].problems) == 2


def test_the_template_end_of_turn_token_ends_generation(tokenizer):
    tok = load_tokenizer(ARITH_MODEL)
    tok.add_special_tokens({"additional_special_tokens": ["<|end|>"]})
    tok.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}<|end|>{% endfor %}"
    assert end_of_turn_ids(tok) == {tok.convert_tokens_to_ids("<|end|>")}
    assert end_of_turn_ids(tokenizer) == set()          # the arith template closes no turn


def sample(problem: Problem, group: int, reward: float, error: str = "", extras=None) -> remote.Sample:
    s = remote.Sample(problem, group, np.array([1], dtype=np.int32), np.array([5, 6], dtype=np.int32),
                      np.zeros(2, dtype=np.float32), "text", "stop", 0)
    s.reward, s.reward_error, s.reward_extras = reward, error, extras or {}
    s.components = {} if error else {"compute_score": reward}
    return s


def test_a_failed_score_is_recorded_as_failed_moves_no_group_statistic_and_trains_on_nothing():
    p = Problem("q", "1+1=", "2", "x", extra_info={"k": 1})
    samples = [sample(p, 0, 1.0, extras={"acc": 1.0}), sample(p, 0, 0.0, extras={"acc": 0.0}),
               sample(p, 0, 0.0, error="reward function f.py:compute_score raised KeyError on items[2]")]
    phases.fill_failed_rewards(samples)
    assert samples[2].reward == 0.5                      # the group's mean: no statistic moves
    metrics = reporting.reward_metrics(samples)
    assert metrics["num_reward_failed"] == 1.0 and metrics["reward_mean"] == 0.5
    assert metrics["reward_extra/acc"] == 0.5
    record = reporting.sample_record(3, samples[2])
    assert record["reward_failed"] is True and record["reward"] is None and "KeyError" in record["reward_error"]
    assert record["extra_info"] == {"k": 1} and json.loads(json.dumps(record))["step"] == 3


def test_chat_prompts_reach_the_model_as_the_plain_prompts_ids_on_the_whole_arith_heldout_set(tokenizer):
    # The template only adds the BOS, so greedy accuracy must match the plain prompts' (0.325 on these 200; the
    # old text path with its second BOS got 0.310).
    rows = [json.loads(line) for line in (Path(ARITH_MODEL).parent / "data" / "heldout.jsonl").read_text().splitlines()]
    chat = [render_chat(tokenizer, [{"role": "user", "content": r["prompt"]}])[1] for r in rows]
    assert [list(ids) for ids in chat] == [tokenizer(r["prompt"])["input_ids"] for r in rows]
