"""The one loader of user reward functions: clear errors for every way a `module:function` can be wrong."""

import asyncio
from pathlib import Path

import pytest

from services.common.config import load_config
from services.reward.config import RewardSettings
from services.reward.engine import RewardEngine
from services.reward.plugins import load_function

REPO = Path(__file__).resolve().parents[2]
FNS = "tests.fixtures.reward_user_fns"


@pytest.fixture(autouse=True)
def repo_on_path(monkeypatch):
    # `tests.fixtures` is imported by module name, as users' code is; spawned workers inherit sys.path.
    monkeypatch.syspath_prepend(str(REPO))


def test_a_good_function_loads_and_is_the_function_itself():
    fn = load_function(f"{FNS}:length_ratio", params=["scale"])
    assert fn(prompt="", response="abcd", response_ids=[], ground_truth="ab", data_source="", scale=0.5) == 1.0


@pytest.mark.parametrize("path, expected", [
    ("nocolon", "not of the form 'package.module:function'"),
    (f"{FNS}:", "not of the form"),
    ("tests.fixtures.no_such_module:f", "cannot import module 'tests.fixtures.no_such_module'"),
    (f"{FNS}:missing", "has no attribute 'missing'"),
    (f"{FNS}:NOT_CALLABLE", "int object is not callable"),
    (f"{FNS}:wrong_signature", "does not accept keyword argument(s) prompt, response_ids, ground_truth, data_source"),
    (f"{FNS}:needs_extra", "'tokenizer'"),
])
def test_a_bad_function_path_or_signature_is_a_value_error_naming_the_path(path, expected):
    with pytest.raises(ValueError) as err:
        load_function(path)
    assert expected in str(err.value)
    assert path in str(err.value)


def test_a_param_the_function_does_not_take_is_refused_at_load():
    load_function(f"{FNS}:moody", params=["anything"])  # **kwargs takes any param
    with pytest.raises(ValueError, match="does not accept keyword argument"):
        load_function(f"{FNS}:needs_extra", params=["scale"])


def test_the_engine_refuses_a_wrong_signature_when_it_starts_and_names_the_component():
    settings = load_config(RewardSettings, data={"reward": {"function": f"{FNS}:wrong_signature"}})
    with pytest.raises(ValueError, match=r"reward.components\[0\] \(wrong_signature\): function"):
        RewardEngine(settings)


def test_a_user_function_with_params_is_scored_in_worker_processes():
    settings = load_config(RewardSettings, data={"reward": {"num_workers": 2, "components": [
        {"name": "ratio", "function": f"{FNS}:length_ratio", "params": {"scale": 2.0}, "weight": 0.5},
        {"name": "exact_match"}]}})

    async def run():
        engine = RewardEngine(settings)
        try:
            from services.reward.types import ScoreItem
            return await engine.score([ScoreItem(id=str(i), response="x" * i, ground_truth="xx") for i in range(5)])
        finally:
            await engine.close()

    results = asyncio.run(run())
    assert [r.components["ratio"] for r in results] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert [r.score for r in results] == [0.0, 0.5, 2.0, 1.5, 2.0]


def test_a_verl_style_compute_score_as_a_meshrl_function_is_refused_with_a_hint_to_use_custom_function():
    with pytest.raises(ValueError) as err:
        load_function(f"{FNS}:verl_compute_score")
    assert "does not accept keyword argument(s) prompt, response, response_ids" in str(err.value)
    assert "reward.custom_function" in str(err.value)


def test_a_verl_style_compute_score_loads_with_verl_keywords():
    fn = load_function(f"{FNS}:verl_compute_score", call="verl")
    assert callable(fn)
