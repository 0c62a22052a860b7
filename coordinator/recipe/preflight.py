"""Checks of a whole run config before anything starts: `meshrl up`, `meshrl run` and StartRun call `check_run`.

pydantic has already checked keys, types and ranges; these checks need several keys at once or the model
folder: the folder holds a model, the trainer mesh fits the launch, every mini-batch splits over the
data-parallel ranks, group estimators get groups, prompt + response fit the model; where the services run on
this machine (`meshrl up`), the user's reward functions import and hold the names given, and where the
coordinator runs (`meshrl up`, StartRun), the loggers' packages are installed. Each failure is one ValueError
whose message starts with the key the user wrote (`model.path`, not the `actor.model_path` it fills in; the verl
key when a verl override set it).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from coordinator.recipe.config import RunConfig, distill_coef
from coordinator.recipe.distill import check_teacher_tokenizer
from coordinator.training.advantages import ADVANTAGE_ESTIMATORS
from services.common.plugins import attribute, load_module, split_path
from services.trainer.config import check_lora_targets, check_mesh

# The weight files transformers' from_pretrained loads: shards, single files, or the index of shards.
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


def _model_folders(cfg: RunConfig) -> dict[str, str]:
    """Each model folder the services load, by the key the user set; unset ones default to model.path and
    are checked under that key (once)."""
    folders = {"model.path": cfg.model.path, "actor.model_path": cfg.actor.model_path,
               "critic.model_path": cfg.critic.model_path if cfg.critic else None,
               "reference.model_path": cfg.reference.model_path}
    return {key: path for key, path in folders.items() if path}


def _data_files(cfg: RunConfig) -> dict[str, list[str]]:
    """The data files the coordinator reads, by key."""
    return {"data.train_files": cfg.data.train_files, "data.heldout_files": cfg.data.heldout_files,
            "dpo.heldout_files": cfg.dpo.heldout_files}


# The files a caller can see, by key: `meshrl up` starts every service here; the coordinator itself reads
# the data and model.path's tokenizer (the trainer and reference may run on other machines); `meshrl run`
# may talk to a coordinator elsewhere, so it leaves the files to StartRun.
_DATA_KEYS = ("data.train_files", "data.heldout_files", "dpo.heldout_files")
FILE_SCOPES = {"all": ("model.path", "actor.model_path", "critic.model_path", "reference.model_path", *_DATA_KEYS,
                       "reward", "loggers"),
               "coordinator": ("model.path", *_DATA_KEYS, "loggers"), "none": ()}


def _reward_functions(cfg: RunConfig) -> list[tuple[str, str, str, str]]:
    """(module, function, key of the module, key of the function) of every user reward function, by the key the
    recipe wrote it under: the shorthands expand into reward.components, whose names the user never typed."""
    r = cfg.reward
    if r.custom_function is not None:
        c = r.custom_function
        listed = [(c.path, c.name, "reward.custom_function.path", "reward.custom_function.name")]
    elif r.function is not None:
        listed = [(*split_path(r.function, "reward.function"), "reward.function", "reward.function")]
    else:
        listed = [(*split_path(c.function, f"reward.components[{i}].function"),
                   f"reward.components[{i}].function", f"reward.components[{i}].function")
                  for i, c in enumerate(r.components) if c.function]
    for source, components in r.by_data_source.items():
        listed += [(*split_path(c.function, f"reward.by_data_source.{source}[{i}].function"),
                    f"reward.by_data_source.{source}[{i}].function",
                    f"reward.by_data_source.{source}[{i}].function") for i, c in enumerate(components) if c.function]
    return listed


def check_reward_functions(cfg: RunConfig) -> None:
    """Each user reward function imports and is there, as the reward service will load it at its start (a path
    relative to the working directory `meshrl up` starts it in)."""
    for module_name, name, module_key, name_key in _reward_functions(cfg):
        module = load_module(module_name, module_key)
        if not callable(attribute(module, name, name_key, module_name)):
            raise ValueError(f"{name_key}: {name!r} in {module_name!r} is not a function")


# The package each metrics logger needs, by the run key that turns it on (coordinator/runapi/sinks.py).
LOGGER_PACKAGES = {"run.wandb_project": ("wandb", "wandb", "wandb"),
                   "run.tensorboard": ("tensorboard", "tensorboard", "tensorboard")}


def check_loggers(cfg: RunConfig) -> None:
    """A logger the run asks for has its package where the coordinator runs: W&B whenever run.wandb_project is
    set, TensorBoard when run.tensorboard is set to true (on by default, it writes no events without it)."""
    asked = {"run.wandb_project": bool(cfg.run.wandb_project),
             "run.tensorboard": cfg.run.tensorboard and "tensorboard" in cfg.run.model_fields_set}
    for key, (logger, module, package) in LOGGER_PACKAGES.items():
        if asked[key] and importlib.util.find_spec(module) is None:
            raise ValueError(f"{key}: {logger!r} needs the {package} package (pip install {package})")


def _from_here(path: str) -> str:
    """Where a relative path was looked for: a recipe's paths are taken from the folder the command runs in, not
    the recipe's own (examples' recipes name paths from the repository's root)."""
    return "" if Path(path).is_absolute() else f" (from the current folder, {Path.cwd()})"


def check_model_folder(key: str, path: str) -> None:
    """A Hugging Face model folder: a config.json and weights."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"{key}: {path!r}{_from_here(path)} is not a folder (a local Hugging Face model folder is "
                         "expected)")
    if not (folder / "config.json").is_file():
        raise ValueError(f"{key}: {path!r} is not a Hugging Face model folder (no config.json)")
    if not any(any(folder.glob(p)) for p in WEIGHT_PATTERNS):
        raise ValueError(f"{key}: {path!r} holds no weights (no *.safetensors or *.bin file, nor their index)")


def check_data_files(key: str, paths: list[str]) -> None:
    for path in paths:
        if not Path(path).is_file():
            raise ValueError(f"{key}: data file {path!r}{_from_here(path)} does not exist")


def check_data_rows(cfg: RunConfig, key: str, paths: list[str]) -> None:
    """Each data file reads as rows: a Parquet file's schema, a JSONL file's first row (read alone, so `meshrl up`
    names a file of the wrong format or a wrong data.prompt_key before any service starts, as opening the run would
    after they all did); a prompt file's rows hold the prompt and the answer. A later malformed row is named when
    the run opens and reads every row."""
    from coordinator.recipe.data import check_columns, check_row_keys, first_row, read_parquet

    d = cfg.data
    # Preference pairs have keys of their own (dpo.chosen_key, ...), read when the run opens.
    prompts = cfg.algorithm.kind != "dpo" and key != "dpo.heldout_files"
    for path in paths:
        try:
            if path.endswith(".parquet"):
                names = read_parquet(path, schema_only=True).names
                if prompts:
                    check_columns(path, names, prompt_key=d.prompt_key, answer_key=d.answer_key)
            else:
                row = first_row(path)
                if prompts:
                    check_row_keys(row, f"data file {path!r} row 0", prompt_key=d.prompt_key,
                                   answer_key=d.answer_key)
        except ValueError as e:
            raise ValueError(f"{key}: {e}") from None


def _smallest_mini_batch(num_samples: int, mini_batch_size: int) -> int:
    """The trainer's cut (services/trainer/batch.py: mini_batches): consecutive mini_batch_size slices, the
    last one shorter; 0 = one mini-batch of everything."""
    size = mini_batch_size or num_samples
    return num_samples % size or size


def check_batches(cfg: RunConfig) -> None:
    """Every mini-batch needs one sample per data-parallel rank (the trainer refuses the step otherwise)."""
    dp = cfg.actor.dp_size
    if cfg.algorithm.kind == "dpo":
        d = cfg.dpo
        num, mbs, keys, what = d.batch_size, d.mini_batch_size, ("dpo.batch_size", "dpo.mini_batch_size"), "pairs"
    else:
        b, n = cfg.data.rollout_batch_size, cfg.rollout.n
        num, mbs = b * n, cfg.algorithm.ppo_mini_batch_size
        keys, what = ("data.rollout_batch_size", "algorithm.ppo_mini_batch_size"), \
            f"samples (data.rollout_batch_size {b} x rollout.n {n})"
    smallest = _smallest_mini_batch(num, mbs)
    if smallest >= dp:
        return
    if not mbs or mbs >= num:
        raise ValueError(f"{keys[0]}: {num} {what} per step cannot be split over actor.dp_size={dp} "
                         f"data-parallel ranks; each rank needs at least one")
    raise ValueError(f"{keys[1]}: {mbs} cuts the step's {num} {what} into mini-batches the smallest of which "
                     f"holds {smallest}, fewer than actor.dp_size={dp} data-parallel ranks; each rank needs at "
                     f"least one of every mini-batch")


def check_groups(cfg: RunConfig) -> None:
    a = cfg.algorithm
    if a.kind == "rl" and ADVANTAGE_ESTIMATORS[a.adv_estimator].needs_groups and cfg.rollout.n < 2:
        raise ValueError(f"rollout.n: algorithm.adv_estimator {a.adv_estimator} compares the samples of each "
                         f"prompt and needs rollout.n >= 2, got {cfg.rollout.n} (one sample has no baseline "
                         f"and trains on nothing)")


def check_rollout_weights(cfg: RunConfig) -> None:
    """An RL run pushes weights to its rollout replicas every step; an `openai` replica takes them only through
    rollout.weights_dir (services/rollout/engine_openai/upstream_weights.py). DPO and evaluation need no weight
    updates."""
    r = cfg.rollout
    if cfg.algorithm.kind == "rl" and r.engine == "openai" and not r.weights_dir:
        raise ValueError(f"rollout.weights_dir: rollout.engine openai proxies {r.server_url} and an RL run "
                         f"({cfg.algorithm.adv_estimator}) pushes weights to it every step; set rollout.weights_dir "
                         f"to a folder that server reads (vllm serve with VLLM_SERVER_DEV_MODE=1), or use it for "
                         f"offline DPO or evaluation only")


def check_proxy_agent(cfg: RunConfig) -> None:
    """The openai_agent loop runs a user's agent program against the rollout replicas' own HTTP API
    (services/rollout/agents/openai_agent.py): it needs the program and the API."""
    from services.rollout.config import AGENT_ALIASES

    agent = cfg.rollout.agent
    if AGENT_ALIASES.get(agent.name, agent.name) != "openai_agent":
        return
    if not agent.program:
        raise ValueError("rollout.agent.program: the openai_agent loop runs this agent program; set it to "
                         "'package.module:function' (fn(base_url, row) -> str | None)")
    if cfg.rollout.http_port is None:
        raise ValueError("rollout.http_port: the openai_agent loop runs its agent program against the rollout "
                         "replicas' HTTP API, which is off; set it (0 = any free port)")


def _max_positions(path: str) -> int | None:
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("max_position_embeddings") or config.get("n_positions")
    return int(value) if isinstance(value, int) else None


def check_lengths(cfg: RunConfig) -> None:
    """Prompt + response fit the model (and rollout.max_model_len) that generates and trains on them."""
    model_len = _max_positions(cfg.model.path)
    if cfg.algorithm.kind != "rl" or model_len is None:
        return
    r, prompt = cfg.rollout, cfg.data.max_prompt_length
    if r.max_model_len and r.max_model_len > model_len:
        raise ValueError(f"rollout.max_model_len: {r.max_model_len} exceeds the model's max_position_embeddings "
                         f"{model_len} (model.path {cfg.model.path!r})")
    limit, where = (r.max_model_len, "rollout.max_model_len") if r.max_model_len else \
        (model_len, f"the model's max_position_embeddings (model.path {cfg.model.path!r})")
    if prompt is not None and prompt + r.max_tokens > limit:
        raise ValueError(f"data.max_prompt_length: {prompt} + rollout.max_tokens {r.max_tokens} = "
                         f"{prompt + r.max_tokens} tokens, over {limit}, {where}")
    if r.max_tokens >= limit:
        raise ValueError(f"rollout.max_tokens: {r.max_tokens} new tokens leave no room for a prompt within "
                         f"{limit} tokens, {where}")


def check_speed_switches(cfg: RunConfig) -> None:
    """An explicit speed switch that cannot work on the configured devices, refused before anything starts (the
    services refuse it too, at their start, for a mesh `meshrl up` does not launch)."""
    device = str(cfg.model.device)
    if cfg.rollout.cuda_graphs is True and cfg.rollout.engine == "torch" and not device.startswith("cuda"):
        raise ValueError(f"rollout.cuda_graphs: true needs a CUDA device (model.device is {device!r}); set it to "
                         "auto or false")
    transport = cfg.weight_sync.transport
    if transport in ("ipc", "nccl") and not device.startswith("cuda"):
        raise ValueError(f"weight_sync.transport: {transport} needs the trainer and replicas on CUDA devices "
                         f"(model.device is {device!r}); set it to auto or grpc")


def check_run(cfg: RunConfig, *, world_size: int | None = None, files: str = "all",
              keys: set[str] | None = None, names: dict[str, str] | None = None) -> None:
    """Raises ValueError (one line, starting with the user's key) for the first check that fails.

    world_size: the trainer ranks the caller launches (`meshrl up`), None when the trainer already runs.
    files: which model folders and data files are on this machine (a key of FILE_SCOPES).
    keys: the keys whose values are final here; a cross-key failure naming another key is left to StartRun,
    which checks again once the running services have filled in the keys the run leaves out (None: all final,
    as in `meshrl up`, which starts the services from this same config).
    names: meshrl key -> the verl key the user typed for it (verl_keys.user_keys); errors name that one.
    """
    try:
        _check_run(cfg, world_size, files, keys)
    except ValueError as e:
        if names:
            from coordinator.recipe.verl_keys import renamed

            raise renamed(e, names) from None
        raise


def _check_run(cfg: RunConfig, world_size: int | None, files: str, keys: set[str] | None) -> None:
    scope = FILE_SCOPES[files]
    if not cfg.model.path.strip():      # the coordinator reads its tokenizer wherever the services run
        raise ValueError("model.path: empty; a local Hugging Face model folder is expected")
    for key, path in _model_folders(cfg).items():
        if key in scope:
            check_model_folder(key, path)
    for key, paths in _data_files(cfg).items():
        if key in scope:
            check_data_files(key, paths)
            check_data_rows(cfg, key, paths)
    if "reward" in scope:
        check_reward_functions(cfg)
    if "loggers" in scope:
        check_loggers(cfg)
    a = cfg.actor
    checks = [lambda: check_batches(cfg), lambda: check_groups(cfg), lambda: check_lengths(cfg),
              lambda: check_rollout_weights(cfg), lambda: check_proxy_agent(cfg), lambda: check_speed_switches(cfg)]
    actor_model = ("actor.model_path", a.model_path) if a.model_path else ("model.path", cfg.model.path)
    teacher = cfg.reference.model_path
    if distill_coef(cfg.algorithm) > 0 and teacher and ("reference.model_path" in scope or Path(teacher).is_dir()):
        # Wherever the teacher's folder is readable (StartRun on a mesh whose reference runs elsewhere: not).
        checks.append(lambda: check_teacher_tokenizer(actor_model[1], teacher))
    if a.lora is not None and actor_model[0] in scope:
        # The model's own layer names: a target that matches none is refused before any process starts.
        checks.append(lambda: check_lora_targets(actor_model[1], a.lora))
    if world_size is not None:
        checks.insert(0, lambda: check_mesh(a.tp_size, a.pp_size, a.dp_size, world_size,
                                            launch="trainer.nproc_per_node"))
    for check in checks:
        try:
            check()
        except ValueError as e:
            if keys is None or str(e).partition(":")[0] in keys:
                raise
