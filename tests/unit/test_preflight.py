"""The checks before anything starts (coordinator/recipe/preflight.py): each broken config fails with one line that
names the key the user wrote."""

import json
from pathlib import Path

import pytest

from coordinator.recipe.config import RunConfig
from coordinator.recipe.preflight import check_run
from services.common.config import load_config


def model_folder(path, *, max_positions=64, weights="model.safetensors"):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": max_positions}))
    if weights:
        (path / weights).write_bytes(b"\0")
    return str(path)


TRAIN = str(Path(__file__).resolve().parents[2] / "examples" / "arith" / "data" / "train.jsonl")


def config(model_path, **sections) -> RunConfig:
    data = {"model": {"path": model_path}, "rollout": {"n": 4, "max_tokens": 8}, "data": {"train_files": [TRAIN]}}
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    return load_config(RunConfig, data=data)


def failure(cfg: RunConfig, **kwargs) -> str:
    with pytest.raises(ValueError) as err:
        check_run(cfg, **kwargs)
    return str(err.value)


def test_a_good_config_passes_every_check(tmp_path):
    check_run(config(model_folder(tmp_path / "m")), world_size=1)


def test_a_missing_model_folder_is_named_by_model_path(tmp_path):
    missing = str(tmp_path / "nope")
    assert failure(config(missing)) == (f"model.path: {missing!r} is not a folder (a local Hugging Face model "
                                        f"folder is expected)")


def test_a_missing_relative_path_says_which_folder_it_was_looked_for_from(tmp_path, monkeypatch):
    # `meshrl mesh /repo/examples/arith/grpo.yaml` run from elsewhere: the recipe's paths are the repo root's
    monkeypatch.chdir(tmp_path)
    assert failure(config("examples/arith/model")) == (
        f"model.path: 'examples/arith/model' (from the current folder, {tmp_path}) is not a folder (a local Hugging "
        f"Face model folder is expected)")


def test_a_folder_without_config_json_is_not_a_model(tmp_path):
    (tmp_path / "m").mkdir()
    path = str(tmp_path / "m")
    assert failure(config(path)) == f"model.path: {path!r} is not a Hugging Face model folder (no config.json)"


def test_a_model_folder_without_weights_is_refused(tmp_path):
    path = model_folder(tmp_path / "m", weights=None)
    assert failure(config(path)) == (f"model.path: {path!r} holds no weights (no *.safetensors or *.bin file, "
                                     f"nor their index)")


def test_an_index_of_shards_counts_as_weights(tmp_path):
    check_run(config(model_folder(tmp_path / "m", weights="model.safetensors.index.json")))


def test_the_actor_model_path_the_user_set_is_named_by_its_own_key(tmp_path):
    missing = str(tmp_path / "actor")
    cfg = config(model_folder(tmp_path / "m"), actor={"model_path": missing})
    assert failure(cfg).startswith(f"actor.model_path: {missing!r} is not a folder")
    # StartRun checks only the folder the coordinator itself reads (the trainer may run elsewhere).
    check_run(cfg, files="coordinator")


def test_meshrl_run_leaves_the_model_folder_to_the_coordinator(tmp_path):
    check_run(config(str(tmp_path / "nope")), files="none")


def test_a_missing_data_file_is_named_by_its_key(tmp_path):
    missing = str(tmp_path / "heldout.jsonl")
    cfg = config(model_folder(tmp_path / "m"), data={"heldout_files": [missing]})
    assert failure(cfg, files="coordinator") == f"data.heldout_files: data file {missing!r} does not exist"
    check_run(cfg, files="none")


def test_a_mesh_that_no_dp_size_fits_says_so(tmp_path):
    cfg = config(model_folder(tmp_path / "m"), actor={"tp_size": 3})
    assert failure(cfg, world_size=2) == (
        "actor.tp_size * actor.pp_size * actor.dp_size = 3 * 1 * 1 = 3, but the trainer has 2 rank(s) "
        "(trainer.nproc_per_node); no actor.dp_size fits: make trainer.nproc_per_node a multiple of "
        "tp_size * pp_size = 3, or lower actor.tp_size / actor.pp_size")


def test_a_mesh_that_another_dp_size_fits_names_that_dp_size(tmp_path):
    cfg = config(model_folder(tmp_path / "m"), actor={"tp_size": 2})
    assert failure(cfg, world_size=4) == (
        "actor.tp_size * actor.pp_size * actor.dp_size = 2 * 1 * 1 = 2, but the trainer has 4 rank(s) "
        "(trainer.nproc_per_node); set actor.dp_size to 2, or change trainer.nproc_per_node")


def test_the_mesh_is_not_checked_when_the_trainer_already_runs(tmp_path):
    check_run(config(model_folder(tmp_path / "m"), actor={"tp_size": 3}), world_size=None)


def test_a_step_smaller_than_the_data_parallel_size_is_refused(tmp_path):
    cfg = config(model_folder(tmp_path / "m"), actor={"dp_size": 4}, data={"rollout_batch_size": 1},
                 rollout={"n": 2})
    assert failure(cfg) == ("data.rollout_batch_size: 2 samples (data.rollout_batch_size 1 x rollout.n 2) per step "
                            "cannot be split over actor.dp_size=4 data-parallel ranks; each rank needs at least one")


def test_a_short_last_mini_batch_is_refused_naming_the_mini_batch_size(tmp_path):
    cfg = config(model_folder(tmp_path / "m"), actor={"dp_size": 4}, data={"rollout_batch_size": 5},
                 rollout={"n": 2}, algorithm={"ppo_mini_batch_size": 8})
    assert failure(cfg) == ("algorithm.ppo_mini_batch_size: 8 cuts the step's 10 samples (data.rollout_batch_size 5 "
                            "x rollout.n 2) into mini-batches the smallest of which holds 2, fewer than "
                            "actor.dp_size=4 data-parallel ranks; each rank needs at least one of every mini-batch")


def test_mini_batches_need_not_divide_the_data_parallel_size(tmp_path):
    # The trainer pads uneven DP shards; it only needs a sample per rank in every mini-batch.
    check_run(config(model_folder(tmp_path / "m"), actor={"dp_size": 4}, data={"rollout_batch_size": 5},
                     rollout={"n": 2}, algorithm={"ppo_mini_batch_size": 6}))


def test_dpo_pairs_are_checked_against_the_data_parallel_size(tmp_path):
    cfg = config(model_folder(tmp_path / "m"), actor={"dp_size": 4}, algorithm={"kind": "dpo"},
                 dpo={"batch_size": 2})
    assert failure(cfg) == ("dpo.batch_size: 2 pairs per step cannot be split over "
                            "actor.dp_size=4 data-parallel ranks; each rank needs at least one")


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_group_estimators_need_two_samples_per_prompt(tmp_path, estimator):
    cfg = config(model_folder(tmp_path / "m"), rollout={"n": 1}, algorithm={"adv_estimator": estimator})
    assert failure(cfg) == (f"rollout.n: algorithm.adv_estimator {estimator} compares the samples of each prompt "
                            f"and needs rollout.n >= 2, got 1 (one sample has no baseline and trains on nothing)")


def test_reinforce_plus_plus_trains_on_one_sample_per_prompt(tmp_path):
    check_run(config(model_folder(tmp_path / "m"), rollout={"n": 1},
                     algorithm={"adv_estimator": "reinforce_plus_plus"}))


def test_prompt_plus_response_longer_than_the_model_is_refused(tmp_path):
    path = model_folder(tmp_path / "m", max_positions=64)
    cfg = config(path, data={"max_prompt_length": 60}, rollout={"max_tokens": 8})
    assert failure(cfg) == (f"data.max_prompt_length: 60 + rollout.max_tokens 8 = 68 tokens, over 64, the model's "
                            f"max_position_embeddings (model.path {path!r})")


def test_new_tokens_that_leave_no_room_for_a_prompt_are_refused(tmp_path):
    path = model_folder(tmp_path / "m", max_positions=64)
    assert failure(config(path, rollout={"max_tokens": 64})) == (
        f"rollout.max_tokens: 64 new tokens leave no room for a prompt within 64 tokens, the model's "
        f"max_position_embeddings (model.path {path!r})")


def test_a_rollout_max_model_len_past_the_model_is_refused(tmp_path):
    path = model_folder(tmp_path / "m", max_positions=64)
    assert failure(config(path, rollout={"max_model_len": 128})) == (
        f"rollout.max_model_len: 128 exceeds the model's max_position_embeddings 64 (model.path {path!r})")


def test_lengths_are_checked_against_rollout_max_model_len_when_set(tmp_path):
    cfg = config(model_folder(tmp_path / "m"), rollout={"max_model_len": 32, "max_tokens": 8},
                 data={"max_prompt_length": 30})
    assert failure(cfg) == ("data.max_prompt_length: 30 + rollout.max_tokens 8 = 38 tokens, over 32, "
                            "rollout.max_model_len")


@pytest.mark.parametrize("sections, line", [
    ({"model": {"path": "/nonexistent/model"}},
     "model.path: '/nonexistent/model' is not a folder (a local Hugging Face model folder is expected)"),
    ({"rollout": {"n": 1}}, "rollout.n: algorithm.adv_estimator grpo compares the samples of each prompt and needs "
                            "rollout.n >= 2, got 1 (one sample has no baseline and trains on nothing)"),
    ({"actor": {"dp_size": 4}, "data": {"rollout_batch_size": 1}, "rollout": {"n": 2}},
     "data.rollout_batch_size: 2 samples (data.rollout_batch_size 1 x rollout.n 2) per step cannot be split over "
     "actor.dp_size=4 data-parallel ranks; each rank needs at least one"),
])
def test_start_run_refuses_a_broken_config_before_calling_any_service(arith_model_path, sections, line):
    import asyncio

    import yaml

    from coordinator.runapi.runs import RunManager
    from coordinator.runapi.store import MemoryStore

    data = {"model": {"path": arith_model_path}, "rollout": {"n": 4}, **sections}
    manager = RunManager(MemoryStore())
    with pytest.raises(ValueError) as err:  # the servicer maps it to INVALID_ARGUMENT
        asyncio.run(manager.start_run(yaml.safe_dump(data)))
    assert str(err.value) == line
    assert asyncio.run(manager.store.list()) == []


@pytest.mark.parametrize("run_id, name, line", [
    ("x/../other-run", "arith", "run_id: 'x/../other-run' cannot name a run"),
    ("..", "arith", "run_id: '..' cannot name a run"),
    ("", "exp/1", "run.name: 'exp/1' cannot name a run"),
])
def test_start_run_refuses_a_run_id_that_is_a_path(arith_model_path, run_id, name, line):
    # The run id names the run's folder under run.run_dir: 'x/../other-run' would write into another run's folder.
    import asyncio

    import yaml

    from coordinator.runapi.runs import RunManager
    from coordinator.runapi.store import MemoryStore

    data = {"model": {"path": arith_model_path}, "rollout": {"n": 4}, "run": {"name": name}}
    manager = RunManager(MemoryStore())
    with pytest.raises(ValueError) as err:  # the servicer maps it to INVALID_ARGUMENT
        asyncio.run(manager.start_run(yaml.safe_dump(data), run_id=run_id))
    assert str(err.value).startswith(line)
    assert asyncio.run(manager.store.list()) == []


def test_a_parquet_file_without_the_prompt_key_column_is_named_before_any_service_starts(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "train.parquet")
    pq.write_table(pa.table({"prompt": [[{"role": "user", "content": "1+1="}]], "data_source": ["arith"],
                             "reward_model": [{"style": "rule", "ground_truth": "2"}]}), path)
    model = model_folder(tmp_path / "m")
    check_run(config(model, data={"train_files": [path]}), world_size=1)          # verl's columns pass
    assert failure(config(model, data={"train_files": [path], "prompt_key": "question"}), world_size=1) == (
        f"data.train_files: data file {path!r}: no column 'question' for the prompt (data.prompt_key: question); its columns: "
        f"prompt, data_source, reward_model")


def test_an_empty_model_path_is_named_before_any_service_starts(tmp_path):
    # Not a Hugging Face hub error from the tokenizer load: `model: {path: }` in a recipe reads as empty.
    assert failure(config(""), world_size=1) == "model.path: empty; a local Hugging Face model folder is expected"


@pytest.mark.parametrize("key,name,text,prompt_key,line", [
    ("data.train_files", "train.csv", "question,answer\n1+1,2\n", "prompt",
     "line 1: invalid JSON (Expecting value); a data file is JSON Lines (one JSON object a line) or .parquet"),
    ("data.heldout_files", "heldout.jsonl", "\n\n", "prompt", "has no rows"),
    ("data.train_files", "train.jsonl", '{"question": "1+1=", "answer": "2"}\n', "prompt",
     "row 0: missing key 'prompt' (data.prompt_key)"),
    ("data.train_files", "train.jsonl", '{"prompt": "1+1=", "answer": "2"}\n', "promt",
     "row 0: missing key 'promt' (data.prompt_key)"),
    ("data.heldout_files", "heldout.jsonl", '{"prompt": "1+1="}\n', "prompt",
     "row 0: missing key 'answer' (data.answer_key) and reward_model.ground_truth"),
])
def test_a_data_file_of_the_wrong_format_or_keys_is_named_by_its_key_before_any_service_starts(
        tmp_path, key, name, text, prompt_key, line):
    path = tmp_path / name
    path.write_text(text)
    files = {"train_files": [str(path)]} if key == "data.train_files" else {"heldout_files": [str(path)]}
    cfg = config(model_folder(tmp_path / "m"), data={**files, "prompt_key": prompt_key})
    assert failure(cfg, world_size=1) == f"{key}: data file {str(path)!r} {line}"
