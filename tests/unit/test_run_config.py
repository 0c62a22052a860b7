"""Bad run configs fail at start with the key named, before any service is called."""

import pytest

from coordinator.runapi.runs import parse_run_config


def test_unknown_key_is_named():
    with pytest.raises(ValueError, match="rollout.temprature: unknown key"):
        parse_run_config("rollout: {temprature: 1.0}")


def test_unknown_section_is_named():
    with pytest.raises(ValueError, match="algorthm: unknown key"):
        parse_run_config("algorthm: {adv_estimator: grpo}")


def test_wrong_type_is_named():
    with pytest.raises(ValueError, match="run.num_steps"):
        parse_run_config("run: {num_steps: many}")


def test_impossible_value_is_named():
    with pytest.raises(ValueError, match="rollout.n"):
        parse_run_config("rollout: {n: 0}")


def test_unknown_estimator_is_named():
    with pytest.raises(ValueError, match="algorithm.adv_estimator"):
        parse_run_config("algorithm: {adv_estimator: magic}")


def test_invalid_yaml_is_reported():
    with pytest.raises(ValueError, match="invalid YAML"):
        parse_run_config("rollout: [unclosed")


def test_invalid_yaml_sent_to_start_run_is_one_line_with_where():
    with pytest.raises(ValueError) as err:
        parse_run_config("model:\n\tpath: examples/arith/model\n")       # a tab-indented recipe
    assert str(err.value) == "config: invalid YAML line 2, column 1: found character '\\t' that cannot start any token"


def test_recipes_parse():
    from pathlib import Path

    # Anchored at the repository, not the directory pytest was started from.
    recipes = sorted((Path(__file__).resolve().parents[2] / "examples" / "arith").glob("*.yaml"))
    assert {r.name for r in recipes} >= {"grpo.yaml", "ppo.yaml", "dpo.yaml"}, recipes
    for recipe in recipes:
        cfg = parse_run_config(recipe.read_text())
        assert cfg.run.num_steps >= 1, recipe
