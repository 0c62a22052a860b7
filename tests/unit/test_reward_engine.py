"""RewardEngine without a server: config checks, weighted combination, input and non-finite errors."""

import asyncio
import math

import pytest

from services.common.config import load_config
from services.reward.config import RewardSettings
from services.reward.engine import RewardEngine
from services.reward.types import ScoreItem


def engine_for(reward: dict) -> RewardEngine:
    return RewardEngine(load_config(RewardSettings, data={"reward": reward}))


def score(engine, items):
    return asyncio.run(engine.score(items))


def test_default_config_scores_by_data_source_exact_match_for_rows_without_one():
    engine = engine_for({})
    [a, b, g] = score(engine, [ScoreItem(id="a", response="82", ground_truth="82"),
                               ScoreItem(id="b", response="81", ground_truth="82"),
                               ScoreItem(id="g", response="so 2+3=5\n#### 5", ground_truth="#### 5",
                                         data_source="openai/gsm8k")])
    assert a.score == 1.0 and a.components == {"default": 1.0}
    assert b.score == 0.0 and b.components == {"default": 0.0}
    assert g.score == 1.0


def test_score_is_the_weighted_sum_and_components_are_reported_unweighted():
    engine = engine_for({"components": [
        {"name": "exact_match", "weight": 2.0},
        {"name": "format", "weight": 0.5, "params": {"pattern": r"\d+"}},
        {"name": "length_penalty", "weight": 0.25, "params": {"max_length": 4, "unit": "chars"}},
    ]})
    [r] = score(engine, [ScoreItem(id="x", response="12", ground_truth="12")])
    assert r.components == {"exact_match": 1.0, "format": 1.0, "length_penalty": pytest.approx(-0.5)}
    assert r.score == pytest.approx(2.0 * 1.0 + 0.5 * 1.0 + 0.25 * -0.5)


def test_the_same_rule_twice_needs_labels_and_reports_each_under_its_label():
    with pytest.raises(ValueError, match=r"components\[1\].*label"):
        engine_for({"components": [{"name": "format", "params": {"pattern": "a"}},
                                   {"name": "format", "params": {"pattern": "b"}}]})
    engine = engine_for({"components": [{"name": "format", "label": "has_a", "params": {"pattern": "a"}},
                                        {"name": "format", "label": "has_b", "params": {"pattern": "b"}}]})
    [r] = score(engine, [ScoreItem(response="a")])
    assert r.components == {"has_a": 1.0, "has_b": 0.0}


@pytest.mark.parametrize("reward, key", [
    ({"components": [{"name": "exact_mtch"}]}, "reward.components[0].name"),
    ({"components": [{"name": "format", "params": {"pattern": "("}}]}, "params.pattern"),
    ({"components": [{"name": "length_penalty", "params": {"max_len": 3}}]}, "params.max_len"),
    ({"components": []}, "reward.components"),
    ({"max_batch_size": 0}, "reward.max_batch_size"),
    ({"components": [{"name": "exact_match", "weight": math.inf}]}, "weight"),
])
def test_bad_config_is_rejected_with_the_key_named(reward, key):
    with pytest.raises(ValueError) as err:
        engine_for(reward)
    assert key in str(err.value)


def test_empty_batch_and_oversized_batch_are_errors_naming_items():
    engine = engine_for({"max_batch_size": 2})
    with pytest.raises(ValueError, match="items: empty batch"):
        score(engine, [])
    with pytest.raises(ValueError, match=r"items: 3 exceed reward.max_batch_size=2"):
        score(engine, [ScoreItem()] * 3)


def test_a_non_finite_reward_fails_that_item_naming_the_sample_index_and_id_and_scores_the_others():
    # No built-in returns NaN, so a stand-in component does (user functions are tested in test_reward_plugins).
    engine = engine_for({"components": [{"name": "exact_match"}]})

    class NanComponent:
        key, weight = "nan_maker", 1.0

        async def score(self, items):
            return [0.0 if it.id != "bad" else float("nan") for it in items]

    engine.components.append(NanComponent())
    ok, bad = score(engine, [ScoreItem(id="ok"), ScoreItem(id="bad")])
    assert ok.error == "" and ok.components == {"exact_match": 1.0, "nan_maker": 0.0}
    assert "items[1]" in bad.error and "'bad'" in bad.error and "nan_maker" in bad.error


def test_a_rule_error_on_one_sample_names_that_sample():
    engine = engine_for({"components": [{"name": "length_penalty", "params": {"max_length": 8}}]})
    with pytest.raises(ValueError, match=r"items\[1\] \(id 'two'\): length_penalty: response_ids"):
        score(engine, [ScoreItem(id="one", response="", response_ids=[]),
                       ScoreItem(id="two", response="text", response_ids=[])])


def test_info_lists_every_component_with_its_weight():
    info = engine_for({"components": [{"name": "exact_match", "weight": 0.7},
                                      {"name": "gsm8k", "weight": 0.3}]}).info()
    assert info["components"] == "exact_match,gsm8k"
    assert info["component.exact_match"].startswith("weight=0.7")
    assert info["component.gsm8k"].startswith("weight=0.3")


MIXED = {"components": [{"name": "exact_match"}],
         "by_data_source": {"gsm8k": [{"name": "gsm8k"}],
                            "math": [{"name": "boxed", "weight": 2.0},
                                     {"name": "length_penalty", "weight": 1.0,
                                      "params": {"max_length": 100, "target": 50}}]}}


def test_items_are_scored_with_the_components_of_their_data_source_and_the_default_otherwise():
    engine = engine_for(MIXED)
    results = score(engine, [
        ScoreItem(id="a", response="#### 7", ground_truth="7", data_source="gsm8k"),
        ScoreItem(id="b", response="7", ground_truth="7", data_source="arith"),
        ScoreItem(id="c", response=r"\boxed{7}", response_ids=[1] * 75, ground_truth="7", data_source="math"),
        ScoreItem(id="d", response="#### 7", ground_truth="7", data_source=""),
    ])
    assert results[0].components == {"gsm8k": 1.0} and results[0].score == 1.0
    assert results[1].components == {"exact_match": 1.0}
    assert results[2].components == {"boxed": 1.0, "length_penalty": pytest.approx(-0.5)}
    assert results[2].score == pytest.approx(2.0 - 0.5)
    assert results[3].components == {"exact_match": 0.0}  # "#### 7" is not the text "7"


def test_an_error_inside_a_data_source_group_names_the_index_in_the_whole_batch():
    engine = engine_for(MIXED)
    with pytest.raises(ValueError, match=r"items\[2\] \(id 'c'\): length_penalty: response_ids"):
        score(engine, [ScoreItem(id="a", data_source="math"), ScoreItem(id="b"),
                       ScoreItem(id="c", response="text", data_source="math")])


def test_a_bad_component_of_one_data_source_is_rejected_naming_its_path():
    with pytest.raises(ValueError, match=r"reward.by_data_source.math\[0\].name: unknown reward 'boxd'"):
        engine_for({"by_data_source": {"math": [{"name": "boxd"}]}})
    with pytest.raises(ValueError, match=r"reward.by_data_source.math: empty"):
        engine_for({"by_data_source": {"math": []}})


def test_info_lists_the_components_of_each_data_source():
    info = engine_for(MIXED).info()
    assert info["components"] == "exact_match"
    assert info["by_data_source.math"] == "boxed,length_penalty"
    assert info["by_data_source.math.component.boxed"].startswith("weight=2")
