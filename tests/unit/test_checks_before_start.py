"""Everything `meshrl up` and `meshrl run` can check runs before any service starts: the user's reward functions
import and hold the names given, the loggers' packages are there, every unknown or unsupported key is named in one
message (with the nearest key), each under the key the user typed; a command-line reward replaces the recipe's."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from coordinator.cli import app
from coordinator.cli import launcher as launcher_module
from coordinator.cli.runs import _load_recipe

ROOT = Path(__file__).resolve().parents[2]
ARITH = ROOT / "examples/arith"
VERL_REWARD = ("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n\n\n"
               "def score(*, prompt, response, response_ids, ground_truth, data_source):\n    return 1.0\n")


@pytest.fixture
def recipe(tmp_path):
    """The arith demo's recipe with absolute paths, its reward a list of components."""
    data = yaml.safe_load((ARITH / "grpo.yaml").read_text())
    data["model"]["path"] = str(ARITH / "model")
    data["data"]["train_files"] = [str(ARITH / "data/train.jsonl")]
    data["data"]["heldout_files"] = [str(ARITH / "data/heldout.jsonl")]
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text(VERL_REWARD)
    return path


@pytest.fixture
def started(monkeypatch):
    """The services `meshrl up` starts: a check that passes lets it reach the launcher, which records and stops."""
    calls = []

    def no_start(self, *args, **kwargs):
        calls.append(args)
        raise RuntimeError("the launcher was reached")

    monkeypatch.setattr(launcher_module.Launcher, "__init__", no_start)
    return calls


def up(recipe: Path, tmp_path: Path, *words: str):
    """`meshrl up` with the words after the recipe; (exit code, output on one line, seconds taken)."""
    start = time.perf_counter()
    result = CliRunner().invoke(app, ["up", str(recipe), *words, "--run-dir", str(tmp_path / "runs")])
    return result.exit_code, " ".join(result.output.split()), time.perf_counter() - start


def test_a_verl_reward_function_name_typo_is_refused_by_its_verl_key_before_any_service(
        recipe, reward_file, tmp_path, started):
    code, out, seconds = up(recipe, tmp_path, f"custom_reward_function.path={reward_file}",
                            "custom_reward_function.name=compute")
    assert code == 2, out
    assert (f"meshrl up: custom_reward_function.name (meshrl reward.custom_function.name): {str(reward_file)!r} has "
            f"no attribute 'compute' (did you mean 'compute_score'?)") in out
    assert "reward.components" not in out.partition("meshrl up:")[2]
    assert started == [] and not (tmp_path / "runs").exists()
    print(f"checked in {seconds:.2f} s")    # the whole command, no service started (pytest -s shows it)


def test_a_missing_reward_file_is_refused_by_the_path_key(recipe, tmp_path, started):
    code, out, _ = up(recipe, tmp_path, f"custom_reward_function.path={tmp_path / 'nope.py'}")
    assert code == 2 and "custom_reward_function.path (meshrl reward.custom_function.path): file" in out, out
    assert started == []


def test_a_component_function_typo_is_refused_by_its_component_key(recipe, reward_file, tmp_path, started):
    data = yaml.safe_load(recipe.read_text())
    data["reward"] = {"components": [{"name": "exact_match"},
                                     {"name": "mine", "function": f"{reward_file}:compute_scor", "call": "verl"}]}
    recipe.write_text(yaml.safe_dump(data))
    code, out, _ = up(recipe, tmp_path)
    assert code == 2, out
    assert f"reward.components[1].function: {str(reward_file)!r} has no attribute 'compute_scor' (did you mean " \
           f"'compute_score'?)" in out
    assert started == []


@pytest.mark.parametrize("words", [["custom_reward_function.path={file}"],
                                   ["--reward.function", "{file}:score"]])
def test_a_reward_that_imports_is_accepted_and_replaces_the_recipes_in_what_the_services_read(
        recipe, reward_file, tmp_path, started, words):
    code, out, _ = up(recipe, tmp_path, *[w.format(file=reward_file) for w in words])
    assert "the launcher was reached" in out and len(started) == 1, out
    assert "replaces the recipe's reward.components" in out
    services_read = yaml.safe_load(Path(started[0][0]).read_text())    # the recipe every service starts from
    assert "components" not in services_read["reward"]


@pytest.mark.parametrize("words, key", [
    (["trainer.logger=['console','wandb']"], "trainer.logger (meshrl run.wandb_project)"),
    (["--run.wandb_project", "arith"], "run.wandb_project"),
])
def test_a_logger_without_its_package_is_refused_by_name(recipe, tmp_path, started, monkeypatch, words, key):
    monkeypatch.setitem(sys.modules, "wandb", None)      # importlib finds no wandb, installed or not
    code, out, _ = up(recipe, tmp_path, *words)
    assert code == 2 and f"{key}: 'wandb' needs the wandb package (pip install wandb)" in out, out
    assert started == []


def test_every_unknown_or_unsupported_key_is_named_in_one_message(recipe, tmp_path, started):
    data = yaml.safe_load(recipe.read_text())
    data["actor"]["lrr"] = 1e-5
    recipe.write_text(yaml.safe_dump(data))
    code, out, _ = up(recipe, tmp_path, "actor_rollout_ref.actor.use_dynamic_bsz=True",
                      "actor_rollout_ref.model.use_remove_padding=True", "trainer.n_gpus_per_node=8",
                      "actor_rollout_ref.rollout.temprature=0.7", "rollout.n=4", "actor_rollout_ref.rollout.n=many",
                      "--rollout.tempratur", "0.5")
    assert code == 2
    for part in ["actor_rollout_ref.actor.use_dynamic_bsz, actor_rollout_ref.model.use_remove_padding, "
                 "trainer.n_gpus_per_node: verl keys that meshrl does not support",
                 "actor_rollout_ref.rollout.temprature: verl key that meshrl does not support (did you mean "
                 "'actor_rollout_ref.rollout.temperature'?)",
                 "rollout.n: verl key that meshrl does not support (a meshrl key: write it --rollout.n 4)",
                 "actor_rollout_ref.rollout.n=many: expected an integer",
                 "rollout.tempratur: unknown key (did you mean 'temperature'?)",
                 "actor.lrr: unknown key (did you mean 'lr'?)"]:
        assert part in out, (part, out)
    assert out.count("meshrl up:") == 1 and started == []      # one message, however many keys


def test_run_reports_the_keys_before_it_calls_any_coordinator(recipe, tmp_path):
    result = CliRunner().invoke(app, ["run", str(recipe), "--coordinator", "127.0.0.1:1",
                                      "actor_rollout_ref.actor.use_dynamic_bsz=True", "--rollout.tempratur", "0.5"])
    out = " ".join(result.output.split())
    assert result.exit_code == 2 and "use_dynamic_bsz" in out and "did you mean 'temperature'" in out, out
    assert "UNAVAILABLE" not in out


def test_a_verl_reward_override_replaces_the_recipes_components_and_says_so_once(recipe, reward_file):
    raw, cfg = _load_recipe(recipe, _verl([f"custom_reward_function.path={reward_file}"]), {})
    assert [(c.function, c.call) for c in cfg.reward.components] == [(f"{reward_file}:compute_score", "verl")]
    assert "components" not in raw["reward"]              # what `meshrl up` hands every service
    result = CliRunner().invoke(app, ["memory", str(recipe), f"custom_reward_function.path={reward_file}"])
    assert result.exit_code == 0, result.output
    assert " ".join(result.output.split()).count(
        "custom_reward_function replaces the recipe's reward.components") == 1


def test_a_meshrl_reward_flag_replaces_the_recipes_reward_too(recipe, reward_file):
    _, cfg = _load_recipe(recipe, {}, {"reward.function": f"{reward_file}:compute_score"})
    assert [c.function for c in cfg.reward.components] == [f"{reward_file}:compute_score"]


def _verl(words):
    from coordinator.recipe import verl_keys

    return verl_keys.parse(words)


@pytest.mark.parametrize("flag, value", [("true", "full"), ("false", "none"), ("True", "full"), ("full", "full"),
                                         ("selective", "selective")])
def test_activation_checkpointing_takes_true_and_false_as_the_docs_say(recipe, flag, value):
    _, cfg = _load_recipe(recipe, {}, {"actor.activation_checkpointing": flag})
    assert cfg.actor.activation_checkpointing == value


def test_yaml_off_is_the_off_choice_not_a_boolean(recipe):
    text = recipe.read_text().replace("algorithm:\n", "algorithm:\n  rollout_correction: {mode: off}\n")
    recipe.write_text(text.replace("rollout:\n", "rollout:\n  partial_rollouts: off\n"))
    _, cfg = _load_recipe(recipe, {}, {})
    assert (cfg.rollout.partial_rollouts, cfg.algorithm.rollout_correction.mode) == ("off", "off")


def test_startrun_checks_the_loggers_where_it_runs_and_leaves_reward_files_to_the_reward_replicas(
        recipe, tmp_path, monkeypatch):
    from coordinator.recipe.preflight import check_run

    monkeypatch.setitem(sys.modules, "wandb", None)
    _, cfg = _load_recipe(recipe, {}, {"run.wandb_project": "arith"})
    with pytest.raises(ValueError, match=r"^run.wandb_project: 'wandb' needs the wandb package"):
        check_run(cfg, files="coordinator")
    check_run(cfg, files="none")             # `meshrl run`: the coordinator may be on another machine
    _, cfg = _load_recipe(recipe, {}, {"reward.function": f"{tmp_path / 'elsewhere.py'}:score"})
    check_run(cfg, files="coordinator")      # the reward replicas load it on their machine
    with pytest.raises(ValueError, match=r"^reward.function: file .* does not exist"):
        check_run(cfg, files="all")
