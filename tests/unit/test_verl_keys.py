"""verl's command-line overrides: each lands on its meshrl key with verl's meaning, anything else is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from coordinator.cli import app
from coordinator.recipe import verl_keys
from coordinator.recipe.config import RunConfig
from services.common.config import load_config

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples/wordproblems/data/train.parquet"


@pytest.fixture
def recipe(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"rollout": {"n": 4, "max_tokens": 32}, "data": {"rollout_batch_size": 8}}))
    return path


def load(recipe: Path, words: list[str], overrides: dict | None = None):
    _, cfg = verl_keys.apply(verl_keys.parse(words),
                             lambda data: load_config(RunConfig, recipe, data=data, overrides=overrides))
    return cfg


def value_at(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


@pytest.mark.parametrize("word, key, value", [
    ("data.train_files=[a.parquet,b.parquet]", "data.train_files", ["a.parquet", "b.parquet"]),
    ("data.train_files=a.parquet", "data.train_files", ["a.parquet"]),
    ("data.val_files=[v.parquet]", "data.heldout_files", ["v.parquet"]),
    ("data.train_batch_size=64", "data.rollout_batch_size", 64),
    ("data.max_prompt_length=256", "data.max_prompt_length", 256),
    ("data.max_response_length=300", "rollout.max_tokens", 300),
    ("actor_rollout_ref.model.path=/models/qwen", "model.path", "/models/qwen"),
    ("actor_rollout_ref.actor.optim.lr=1e-6", "actor.lr", 1e-6),
    ("actor_rollout_ref.actor.use_kl_loss=True", "algorithm.use_kl_loss", True),
    ("actor_rollout_ref.actor.kl_loss_coef=0.01", "algorithm.kl_loss_coef", 0.01),
    ("actor_rollout_ref.actor.kl_loss_type=low_var_kl", "algorithm.kl_loss_type", "k3"),
    ("actor_rollout_ref.actor.kl_loss_type=mse", "algorithm.kl_loss_type", "k2"),
    ("actor_rollout_ref.actor.entropy_coeff=0.001", "algorithm.entropy_coeff", 0.001),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "algorithm.policy_loss.name", "gspo"),
    ("actor_rollout_ref.actor.clip_ratio_high=0.28", "algorithm.policy_loss.clip_ratio_high", 0.28),
    ("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm", "algorithm.loss_agg_mode",
     "seq-mean-token-sum-norm"),
    ("actor_rollout_ref.actor.loss_scale_factor=300", "algorithm.loss_scale_factor", 300.0),
    ("algorithm.norm_adv_by_std_in_grpo=false", "algorithm.norm_adv_by_std", False),
    ("actor_rollout_ref.rollout.n=8", "rollout.n", 8),
    ("actor_rollout_ref.rollout.temperature=0.7", "rollout.temperature", 0.7),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size=1", "rollout.vllm_engine_args", {}),
    ("algorithm.adv_estimator=rloo", "algorithm.adv_estimator", "rloo"),
    ("algorithm.use_kl_in_reward=true", "algorithm.use_kl_in_reward", True),
    ("algorithm.kl_ctrl.kl_coef=0.002", "algorithm.kl_coef", 0.002),
    ("trainer.total_training_steps=7", "run.num_steps", 7),
    ("trainer.save_freq=10", "run.checkpoint_every", 10),
    ("trainer.save_freq=-1", "run.checkpoint_every", 0),
    ("trainer.test_freq=5", "run.eval_every", 5),
    ("trainer.logger=[console,tensorboard]", "run.tensorboard", True),
    ("trainer.logger=console", "run.tensorboard", False),
    ("+trainer.experiment_name=gsm8k-grpo", "run.name", "gsm8k-grpo"),
    ("++actor_rollout_ref.rollout.n=2", "rollout.n", 2),
    ("custom_reward_function.path=rewards/mine.py", "reward.custom_function.path", "rewards/mine.py"),
    ("actor_rollout_ref.rollout.multi_turn.enable=true", "rollout.agent.name", "tool_agent"),
    ("actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5", "rollout.agent.max_turns", 5),
    ("actor_rollout_ref.rollout.multi_turn.format=hermes", "rollout.agent.tool_call_parser", "hermes"),
])
def test_each_verl_key_lands_on_its_meshrl_key(recipe, word, key, value):
    assert value_at(load(recipe, [word]), key) == value


def test_custom_reward_function_name_travels_with_its_path(recipe):
    cfg = load(recipe, ["custom_reward_function.path=r.py", "custom_reward_function.name=score"])
    assert (cfg.reward.custom_function.path, cfg.reward.custom_function.name) == ("r.py", "score")


def test_ppo_mini_batch_size_counts_prompts_so_meshrl_gets_it_times_n(recipe):
    # verl: 16 prompts per optimizer step; meshrl counts samples: 16 x n.
    assert load(recipe, ["actor_rollout_ref.actor.ppo_mini_batch_size=16"]).algorithm.ppo_mini_batch_size == 64
    cfg = load(recipe, ["actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.rollout.n=8"])
    assert cfg.algorithm.ppo_mini_batch_size == 128


def test_ppo_micro_batch_per_gpu_becomes_a_token_budget_of_that_many_longest_samples(recipe):
    cfg = load(recipe, ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "data.max_prompt_length=100"])
    assert cfg.actor.micro_batch_token_budget == 4 * (100 + 32)


def test_total_epochs_counts_whole_batches_of_the_training_rows(recipe):
    rows = 5000  # examples/wordproblems/data/train.parquet
    cfg = load(recipe, [f"data.train_files=[{TRAIN}]", "trainer.total_epochs=2", "data.train_batch_size=64"])
    assert cfg.run.num_steps == rows // 64 * 2
    cfg = load(recipe, [f"data.train_files=[{TRAIN}]", "trainer.total_epochs=2", "trainer.total_training_steps=3"])
    assert cfg.run.num_steps == 3


def test_meshrl_flags_win_over_verl_keys(recipe):
    assert load(recipe, ["actor_rollout_ref.rollout.n=8"], {"rollout.n": "3"}).rollout.n == 3


def test_wandb_logger_takes_the_project_name(recipe):
    cfg = load(recipe, ["trainer.logger=[console,wandb]", "trainer.project_name=gsm8k"])
    assert cfg.run.wandb_project == "gsm8k"


@pytest.mark.parametrize("words, named", [
    (["actor_rollout_ref.actor.use_dynamic_bsz=True"], "actor_rollout_ref.actor.use_dynamic_bsz"),
    (["critic.optim.lr=1e-5"], "critic.optim.lr"),
    (["+data.return_raw_chat=True"], "data.return_raw_chat"),
    (["~data.val_files"], "~data.val_files"),
    (["actor_rollout_ref.actor.kl_loss_type=abs"], "actor_rollout_ref.actor.kl_loss_type"),
    (["actor_rollout_ref.rollout.name=sglang"], "actor_rollout_ref.rollout.name"),
    (["actor_rollout_ref.rollout.n=many"], "actor_rollout_ref.rollout.n"),
    (["actor_rollout_ref.rollout.n=0"], "actor_rollout_ref.rollout.n"),
    (["algorithm.adv_estimator=remax"], "algorithm.adv_estimator"),
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=2"], "tensor_model_parallel_size"),
    (["trainer.logger=[console,mlflow]"], "trainer.logger"),
    (["trainer.nnodes=2"], "trainer.nnodes"),
    (["data.train_files=[a,"], "data.train_files"),
])
def test_a_verl_key_or_value_meshrl_cannot_honour_is_refused_by_name(recipe, words, named):
    with pytest.raises(ValueError, match=named.replace("+", r"\+")):
        load(recipe, words)


def test_rollout_tensor_parallel_goes_to_vllm(recipe):
    cfg = load(recipe, ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"])
    assert cfg.rollout.vllm_engine_args == {"tensor_parallel_size": 2}


def test_verl_words_split_from_meshrl_flags():
    verl, flags = verl_keys.split_args(["data.train_batch_size=4", "--rollout.n", "4", "--run.seed=1",
                                        "actor_rollout_ref.rollout.n=2"])
    assert verl == ["data.train_batch_size=4", "actor_rollout_ref.rollout.n=2"]
    assert flags == ["--rollout.n", "4", "--run.seed=1"]


def test_every_verl_key_is_in_the_docs_table():
    doc = (ROOT / "docs/from_verl.md").read_text()
    assert [k for k in verl_keys.VERL_KEYS if f"`{k}`" not in doc] == []


@pytest.mark.parametrize("command", ["up", "run"])
def test_a_verl_override_line_meshrl_lacks_is_refused_by_name(recipe, tmp_path, command):
    result = CliRunner().invoke(app, [command, str(recipe), "data.train_batch_size=4",
                                      "actor_rollout_ref.actor.fsdp_config.param_offload=True",
                                      "--run.run_dir", str(tmp_path / "runs")])
    assert result.exit_code == 2, result.output
    assert "actor_rollout_ref.actor.fsdp_config.param_offload: verl key that meshrl does not support" in \
        " ".join(result.output.split())
    assert not (tmp_path / "runs").exists()


def test_up_refuses_a_verl_value_by_its_verl_key_before_anything_starts(recipe, tmp_path):
    result = CliRunner().invoke(app, ["up", str(recipe), "actor_rollout_ref.rollout.n=0",
                                      "--run-dir", str(tmp_path / "runs")])
    assert result.exit_code == 2, result.output
    assert "actor_rollout_ref.rollout.n (meshrl rollout.n)" in " ".join(result.output.split())
    assert not (tmp_path / "runs").exists()


def test_custom_reward_function_name_without_its_path_names_the_verl_key(recipe):
    with pytest.raises(ValueError, match=r"custom_reward_function\.path \(meshrl reward\.custom_function\.path\): Field required"):
        load(recipe, ["custom_reward_function.name=score"])
