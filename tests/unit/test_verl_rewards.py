"""verl rewards: a compute_score file plugs in unchanged (keywords, sync or async, float or dict), extra keys come
back for metrics, a failed score is a failed item naming the function and the row; built-in GSM8K and MATH
scorers chosen by data_source."""

import asyncio
import textwrap

import pytest

from services.common.config import load_config
from services.reward.config import RewardConfig, RewardSettings
from services.reward.engine import RewardEngine
from services.reward.functions import REWARD_FUNCTIONS, gsm8k, math_answer, normalise_math_answer
from services.reward.types import ScoreItem

VERL_FILE = '''
import asyncio


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "raise":
        raise KeyError("no such thing")
    if solution_str == "nan":
        return float("nan")
    if solution_str == "no score":
        return {"acc": 1.0}
    correct = float(solution_str.strip() == ground_truth)
    return {"score": correct, "acc": correct, "split_is_train": float(extra_info["split"] == "train"),
            "pred": solution_str}


async def async_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    await asyncio.sleep(0)
    return float(solution_str == ground_truth) + bonus + extra_info.get("index", 0)
'''


@pytest.fixture
def verl_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent(VERL_FILE))
    return str(path)


def run_engine(reward: dict, items):
    async def main():
        engine = RewardEngine(load_config(RewardSettings, data={"reward": {"num_workers": 1, **reward}}))
        try:
            return await engine.score(items)
        finally:
            await engine.close()

    return asyncio.run(main())


def item(i: int, response: str, **kw) -> ScoreItem:
    return ScoreItem(id=f"q{i}", response=response, ground_truth="82", data_source="openai/gsm8k",
                     extra_info={"split": "train", "index": i}, **kw)


def test_a_verl_file_plugs_in_with_keywords_and_its_dict_keys_come_back_as_extras(verl_file):
    ok, wrong = run_engine({"custom_function": {"path": verl_file}}, [item(0, "82"), item(1, "81")])
    assert (ok.score, ok.error) == (1.0, "") and ok.components == {"compute_score": 1.0}
    # extra_info reached the function; non-numeric keys (pred) stay out of the metrics
    assert ok.extras == {"acc": 1.0, "split_is_train": 1.0}
    assert wrong.score == 0.0 and wrong.extras["acc"] == 0.0


def test_an_async_verl_function_with_reward_kwargs_is_awaited(verl_file):
    [a, b] = run_engine({"custom_function": {"path": verl_file, "name": "async_score", "reward_kwargs": {"bonus": 0.5}}},
                        [item(0, "82"), item(3, "0")])
    assert (a.score, b.score) == (1.5, 3.5)


def test_raising_nan_or_no_score_fails_only_that_item_naming_the_function_and_row(verl_file):
    results = run_engine({"custom_function": {"path": verl_file}},
                         [item(0, "raise"), item(1, "nan"), item(2, "no score"), item(3, "82")])
    raised, nan, no_score, fine = results
    assert "my_reward.py:compute_score raised KeyError" in raised.error and "items[0] (id 'q0')" in raised.error
    assert "not a finite number" in nan.error and "items[1]" in nan.error
    assert "a dict without 'score' (keys: acc)" in no_score.error and "items[2]" in no_score.error
    assert fine.error == "" and fine.score == 1.0


def test_a_verl_file_with_a_wrong_signature_is_refused_at_start_naming_it(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("def compute_score(solution, answer):\n    return 0.0\n")
    with pytest.raises(ValueError) as err:
        RewardEngine(load_config(RewardSettings, data={"reward": {"custom_function": {"path": str(path)}}}))
    assert "bad.py:compute_score" in str(err.value) and "solution_str" in str(err.value)


def test_a_missing_verl_file_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match="nope.py' does not exist"):
        RewardEngine(load_config(RewardSettings, data={"reward": {"custom_function": {"path": str(tmp_path / "nope.py")}}}))


def test_custom_function_and_components_together_are_refused():
    with pytest.raises(ValueError, match="reward.custom_function is set with"):
        RewardConfig(custom_function={"path": "r.py"}, components=[{"name": "exact_match"}])


def gsm(response, truth="#### 72", **kw):
    return gsm8k(prompt="", response=response, response_ids=[], ground_truth=truth, data_source="", **kw)


def test_gsm8k_strict_reads_the_last_answer_line_and_flexible_the_last_number():
    assert gsm("48+24=72\n#### 72") == 1.0
    assert gsm("#### 1,072", truth="Natalia sold 1072 clips.\n#### 1072") == 1.0
    assert gsm("48+24=72") == 0.0                                   # strict: no answer line
    assert gsm("48+24=72", mode="flexible") == 1.0
    assert gsm("#### 70", format_score=0.1) == 0.1


def test_math_takes_the_last_boxed_answer_and_normalises_it():
    def score(response, truth):
        return math_answer(prompt="", response=response, response_ids=[], ground_truth=truth, data_source="")

    assert score("first \\boxed{3}, finally \\boxed{\\dfrac12}", "\\frac{1}{2}") == 1.0
    assert score("\\boxed{0.5}", "The answer is $\\boxed{\\frac{1}{2}}$.") == 1.0
    assert score("\\boxed{x = 5}", "5") == 1.0
    assert score("\\boxed{10^\\circ}", "10") == 1.0
    assert score("\\boxed{3/4}", "\\frac34") == 1.0
    assert score("\\boxed{4}", "5") == 0.0 and score("no box", "5") == 0.0
    assert normalise_math_answer("\\left( 1, 2 \\right)") == "(1,2)"


@pytest.mark.parametrize("source, response, truth", [
    ("openai/gsm8k", "2+3=5\n#### 5", "5"),
    ("lighteval/MATH", "so \\boxed{\\frac{1}{2}}", "\\frac12"),
    ("DigitalLearningGmbH/MATH-lighteval", "\\boxed{2}", "2"),
    ("", "82", "82"),
])
def test_the_default_reward_picks_the_built_in_scorer_by_data_source(source, response, truth):
    fn = REWARD_FUNCTIONS["default"]
    assert fn(prompt="", response=response, response_ids=[], ground_truth=truth, data_source=source) == 1.0


def test_the_default_reward_refuses_an_unknown_data_source_naming_it():
    with pytest.raises(ValueError) as err:
        RewardConfig().check_data_sources({"acme/riddles": "data file 't.parquet' row 4"})
    assert str(err.value).startswith("reward.components: data file 't.parquet' row 4: data_source 'acme/riddles' "
                                     "has no default reward")
    RewardConfig(components=[{"name": "exact_match"}]).check_data_sources({"acme/riddles": "row 4"})  # not default
