"""verl's command-line overrides (`actor_rollout_ref.rollout.n=8`), read as meshrl keys with verl's meaning.

`meshrl up` and `meshrl run` take them after the recipe, as verl's Hydra command line writes them. Each verl key
maps to a meshrl key (VERL_KEYS); batch sizes are counted as verl counts them (ppo_mini_batch_size in prompts,
meshrl's algorithm.ppo_mini_batch_size in samples: times rollout.n). A key that is not in the table is refused
by name, never ignored; so is a value meshrl cannot honour. docs/from_verl.md is the table for users.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from services.common.config import deep_merge, did_you_mean, keys_beside, nest_overrides

# verl's default data.max_prompt_length: the prompt length a micro-batch's token budget assumes when unset.
VERL_MAX_PROMPT_LENGTH = 512
# verl's default trainer.project_name, the W&B project of `trainer.logger=[console,wandb]` without one.
VERL_PROJECT_NAME = "verl_examples"
Resolve = Callable[[Any, Any, dict], dict]  # (value, the run config without it, every verl value) -> meshrl keys


@dataclass(frozen=True)
class VerlKey:
    """How one verl key becomes meshrl keys: `target` takes the parsed value as it is; `resolve` computes the
    meshrl keys from the value and the rest of the config (counts that depend on rollout.n, the data size)."""

    parse: Callable[[str, Any], Any]
    target: str = ""
    resolve: Resolve | None = None
    meaning: str = ""


def _int(key: str, v: Any) -> int:
    try:
        return int(str(v))
    except ValueError:
        raise ValueError(f"{key}={v}: expected an integer") from None


def _float(key: str, v: Any) -> float:
    try:
        return float(str(v))
    except ValueError:
        raise ValueError(f"{key}={v}: expected a number") from None


def _bool(key: str, v: Any) -> bool:
    if isinstance(v, bool) or str(v).lower() in ("true", "false"):
        return v if isinstance(v, bool) else str(v).lower() == "true"
    raise ValueError(f"{key}={v}: expected true or false")


def _str(key: str, v: Any) -> str:
    if isinstance(v, (list, dict)):
        raise ValueError(f"{key}={v}: expected one value, not a list")
    return str(v)


def _list(key: str, v: Any) -> list[str]:
    """A Hydra list `[a,b]` or one value (verl takes a single path for a file list)."""
    items = v if isinstance(v, list) else [v]
    if not items or any(isinstance(x, (list, dict)) or x is None for x in items):
        raise ValueError(f"{key}={v}: expected a value or a list [a,b]")
    return [str(x) for x in items]


def _files(key: str, v: Any) -> list[str]:
    return [str(Path(p).expanduser()) for p in _list(key, v)]


def _freq(key: str, v: Any) -> int:
    """verl's save/test frequency: steps between events, -1 (or 0) for never; meshrl's 0 is never."""
    return max(_int(key, v), 0)


def _choice(mapping: dict[str, str]) -> Callable[[str, Any], str]:
    def parse(key: str, v: Any) -> str:
        if str(v) not in mapping:
            raise ValueError(f"{key}={v}: meshrl has no such setting (it takes {', '.join(mapping)})")
        return mapping[str(v)]
    return parse


def _mini_batch(value: int, cfg, _: dict) -> dict:
    return {"algorithm.ppo_mini_batch_size": value * cfg.rollout.n}


def _micro_batch(value: int, cfg, _: dict) -> dict:
    longest = (cfg.data.max_prompt_length or VERL_MAX_PROMPT_LENGTH) + cfg.rollout.max_tokens
    return {"actor.micro_batch_token_budget": value * longest}


def _rollout_tp(value: int, cfg, _: dict) -> dict:
    if value == 1:
        return {}
    if cfg.rollout.engine != "vllm":
        raise ValueError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={value}: the {cfg.rollout.engine!r} "
                         f"rollout engine has no tensor parallelism; set actor_rollout_ref.rollout.name=vllm "
                         f"(meshrl rollout.engine vllm) or 1")
    return {"rollout.vllm_engine_args.tensor_parallel_size": value}


def _num_rows(path: str) -> int:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"trainer.total_epochs: counts the rows of data.train_files, and {path!r} is not a file "
                         f"here; give trainer.total_training_steps instead")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(p).metadata.num_rows
    with p.open() as f:
        return sum(1 for line in f if line.strip())


def _epochs(value: int, cfg, given: dict) -> dict:
    """verl's step count: whole batches of the training rows (the last partial batch dropped) times epochs;
    trainer.total_training_steps, when given too, wins as in verl."""
    if "trainer.total_training_steps" in given:
        return {}
    rows = sum(_num_rows(f) for f in cfg.data.train_files)
    steps = rows // cfg.data.rollout_batch_size * value
    if steps < 1:
        raise ValueError(f"trainer.total_epochs={value}: {rows} training rows make no whole batch of "
                         f"data.train_batch_size={cfg.data.rollout_batch_size} prompts")
    return {"run.num_steps": steps}


def _logger(value: list[str], _cfg, given: dict) -> dict:
    known = ("console", "tensorboard", "wandb")
    for sink in value:
        if sink not in known:
            raise ValueError(f"trainer.logger: meshrl cannot log to {sink!r} (it takes {', '.join(known)}; "
                             f"metrics.jsonl is always written)")
    out: dict[str, Any] = {"run.tensorboard": "tensorboard" in value}
    if "wandb" in value:
        out["run.wandb_project"] = str(given.get("trainer.project_name", VERL_PROJECT_NAME))
    return out


def _one_node(value: int, _cfg, _: dict) -> dict:
    if value != 1:
        raise ValueError(f"trainer.nnodes={value}: `meshrl up` starts every service on this host; for several "
                         f"nodes run the services on each (docs/deploy.md)")
    return {}


def _unused(_value, _cfg, _: dict) -> dict:
    return {}


def _multi_turn(value: bool, cfg, _: dict) -> dict:
    """multi_turn.enable=true: the run's prompts are tool-calling episodes unless the recipe names another loop."""
    return {"rollout.agent.name": cfg.rollout.agent.name or "tool_agent"} if value else {}


_KL_TYPES = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}
_ENGINES = {"vllm": "vllm", "hf": "torch"}
_FILTER_METRICS = {"acc": "acc", "score": "score", "seq_reward": "seq_reward"}
A, R = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout."
VERL_KEYS: dict[str, VerlKey] = {
    "data.train_files": VerlKey(_files, "data.train_files", meaning="training Parquet/JSONL files"),
    "data.val_files": VerlKey(_files, "data.heldout_files", meaning="held-out files, scored greedily"),
    "data.train_batch_size": VerlKey(_int, "data.rollout_batch_size", meaning="prompts per step"),
    "data.max_prompt_length": VerlKey(_int, "data.max_prompt_length", meaning="prompt tokens"),
    "data.max_response_length": VerlKey(_int, "rollout.max_tokens", meaning="response tokens per sample"),
    "data.prompt_key": VerlKey(_str, "data.prompt_key", meaning="column of the prompt"),
    "data.shuffle": VerlKey(_bool, "data.shuffle", meaning="shuffle every epoch"),
    "data.reward_fn_key": VerlKey(_str, "data.reward_fn_key", meaning="column that picks the reward"),
    "data.filter_overlong_prompts": VerlKey(_bool, "data.filter_overlong_prompts",
                                            meaning="drop prompts over max_prompt_length (false: refuse them)"),
    "data.truncation": VerlKey(_choice({"error": "error"}), resolve=_unused,
                               meaning="error (meshrl never truncates a prompt)"),
    "actor_rollout_ref.model.path": VerlKey(_str, "model.path", meaning="local Hugging Face model folder"),
    "actor_rollout_ref.model.enable_gradient_checkpointing": VerlKey(_bool, "actor.activation_checkpointing",
                                                                     meaning="activation checkpointing"),
    A + "ppo_mini_batch_size": VerlKey(_int, resolve=_mini_batch,
                                       meaning="prompts per optimizer step; meshrl counts samples: x rollout.n"),
    A + "ppo_micro_batch_size_per_gpu": VerlKey(
        _int, resolve=_micro_batch, meaning="samples per forward/backward (memory only); meshrl packs micro-batches "
        "by tokens: x (max_prompt_length + max_response_length)"),
    A + "ppo_epochs": VerlKey(_int, "algorithm.ppo_epochs", meaning="passes over each batch"),
    A + "optim.lr": VerlKey(_float, "actor.lr", meaning="actor learning rate"),
    A + "use_kl_loss": VerlKey(_bool, "algorithm.use_kl_loss", meaning="KL to the reference as a loss term"),
    A + "kl_loss_coef": VerlKey(_float, "algorithm.kl_loss_coef", meaning="its weight"),
    A + "kl_loss_type": VerlKey(_choice(_KL_TYPES), "algorithm.kl_loss_type",
                                meaning="kl/k1, mse/k2, low_var_kl/k3 (abs and full are refused)"),
    A + "entropy_coeff": VerlKey(_float, "algorithm.entropy_coeff", meaning="entropy bonus"),
    A + "policy_loss.loss_mode": VerlKey(_str, "algorithm.policy_loss.name",
                                         meaning="vanilla, gspo, gspo_token, cispo (docs/algorithms.md)"),
    A + "clip_ratio_low": VerlKey(_float, "algorithm.policy_loss.clip_ratio_low", meaning="clip below 1"),
    A + "clip_ratio_high": VerlKey(_float, "algorithm.policy_loss.clip_ratio_high", meaning="clip above 1"),
    A + "clip_ratio_c": VerlKey(_float, "algorithm.policy_loss.clip_ratio_c", meaning="dual-clip constant (vanilla)"),
    A + "loss_agg_mode": VerlKey(_str, "algorithm.loss_agg_mode",
                                 meaning="token-mean, seq-mean-token-mean, seq-mean-token-sum(-norm)"),
    A + "loss_scale_factor": VerlKey(_float, "algorithm.loss_scale_factor",
                                     meaning="seq-mean-token-sum-norm's constant length"),
    R + "n": VerlKey(_int, "rollout.n", meaning="samples per prompt"),
    R + "temperature": VerlKey(_float, "rollout.temperature", meaning="sampling temperature"),
    R + "top_p": VerlKey(_float, "rollout.top_p", meaning="nucleus sampling"),
    R + "name": VerlKey(_choice(_ENGINES), "rollout.engine", meaning="vllm, or hf (meshrl's torch engine)"),
    R + "gpu_memory_utilization": VerlKey(_float, "rollout.gpu_memory_utilization", meaning="vLLM memory share"),
    R + "tensor_model_parallel_size": VerlKey(
        _int, resolve=_rollout_tp, meaning="vLLM tensor parallel size (1 on any engine; more needs vllm)"),
    R + "multi_turn.enable": VerlKey(_bool, resolve=_multi_turn,
                                     meaning="true: play prompts as tool_agent episodes (rows' agent_name still pick)"),
    R + "multi_turn.max_assistant_turns": VerlKey(_int, "rollout.agent.max_turns", meaning="model turns per episode"),
    R + "multi_turn.format": VerlKey(_choice({"hermes": "hermes"}), "rollout.agent.tool_call_parser",
                                     meaning="tool-call format: hermes"),
    "algorithm.adv_estimator": VerlKey(_str, "algorithm.adv_estimator", meaning="grpo, rloo, gae, ..."),
    "algorithm.norm_adv_by_std_in_grpo": VerlKey(_bool, "algorithm.norm_adv_by_std", meaning="false: Dr. GRPO"),
    "algorithm.gamma": VerlKey(_float, "algorithm.gamma", meaning="GAE discount"),
    "algorithm.lam": VerlKey(_float, "algorithm.lam", meaning="GAE lambda"),
    "algorithm.use_kl_in_reward": VerlKey(_bool, "algorithm.use_kl_in_reward", meaning="KL as a reward penalty"),
    "algorithm.kl_ctrl.type": VerlKey(_choice({"fixed": "fixed", "adaptive": "adaptive"}), "algorithm.kl_ctrl",
                                      meaning="fixed or adaptive penalty"),
    "algorithm.kl_ctrl.kl_coef": VerlKey(_float, "algorithm.kl_coef", meaning="the penalty's (initial) weight"),
    "algorithm.kl_ctrl.target_kl": VerlKey(_float, "algorithm.target_kl", meaning="adaptive target"),
    "algorithm.kl_ctrl.horizon": VerlKey(_int, "algorithm.kl_horizon", meaning="adaptive horizon"),
    # DAPO (docs/dynamic_sampling.md).
    "algorithm.filter_groups.enable": VerlKey(_bool, "algorithm.filter_groups.enable",
                                              meaning="dynamic sampling: drop groups without variance, refill"),
    "algorithm.filter_groups.metric": VerlKey(_choice(_FILTER_METRICS), "algorithm.filter_groups.metric",
                                              meaning="acc, score or seq_reward (seq_final_reward is refused)"),
    "algorithm.filter_groups.max_num_gen_batches": VerlKey(
        _freq, "algorithm.filter_groups.max_num_gen_batches",
        meaning="generation batches per step; 0 or below: no bound; reached short, the step trains on what it kept"),
    "reward_model.overlong_buffer.enable": VerlKey(_bool, "algorithm.overlong_buffer.enable",
                                                   meaning="soft overlong penalty, added to the reward"),
    "reward_model.overlong_buffer.len": VerlKey(_int, "algorithm.overlong_buffer.len",
                                                meaning="tokens before data.max_response_length where it grows"),
    "reward_model.overlong_buffer.penalty_factor": VerlKey(_float, "algorithm.overlong_buffer.penalty_factor",
                                                           meaning="the penalty at the limit"),
    "reward_model.overlong_buffer.log": VerlKey(_bool, resolve=_unused,
                                                meaning="ignored: reward/overlong_penalty is always a metric"),
    "trainer.total_epochs": VerlKey(_int, resolve=_epochs,
                                    meaning="epochs; meshrl counts steps: rows // train_batch_size x epochs"),
    "trainer.total_training_steps": VerlKey(_int, "run.num_steps", meaning="steps (wins over total_epochs)"),
    "trainer.save_freq": VerlKey(_freq, "run.checkpoint_every", meaning="steps between checkpoints; -1 never"),
    "trainer.test_freq": VerlKey(_freq, "run.eval_every", meaning="steps between held-out evaluations; -1 never"),
    "trainer.logger": VerlKey(_list, resolve=_logger, meaning="console, tensorboard, wandb"),
    "trainer.project_name": VerlKey(_str, resolve=_unused, meaning="W&B project (with logger wandb)"),
    "trainer.experiment_name": VerlKey(_str, "run.name", meaning="run name"),
    "trainer.nnodes": VerlKey(_int, resolve=_one_node, meaning="1 (meshrl up runs on one host)"),
    "custom_reward_function.path": VerlKey(_str, "reward.custom_function.path", meaning="verl reward file"),
    "custom_reward_function.name": VerlKey(_str, "reward.custom_function.name", meaning="its function"),
}


def split_args(args: list[str]) -> tuple[list[str], list[str]]:
    """verl's `key=value` words apart from meshrl's `--section.key value` flags (a flag's value word stays with
    it); anything else stays with the flags, whose parser names it."""
    verl, flags, i = [], [], 0
    while i < len(args):
        word = args[i]
        if word.startswith("--"):
            take = 1 if "=" in word else 2
            flags += args[i:i + take]
            i += take
            continue
        (verl if "=" in word or word.startswith("~") else flags).append(word)
        i += 1
    return verl, flags


def _value(raw: str) -> Any:
    """A Hydra value: `[a,b]` a list, quotes stripped, `null` None; scalars stay text for the key's parser."""
    raw = raw.strip()
    if raw.startswith("["):
        try:
            out = yaml.safe_load(raw)
        except yaml.YAMLError:
            out = None
        if not isinstance(out, list):
            raise ValueError(f"{raw!r}: not a list (Hydra lists are written [a,b])")
        return out
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
        return raw[1:-1]
    return None if raw in ("null", "~") else raw


class VerlArgs(dict):
    """verl key -> parsed value, and `problems`: one line per word that was refused (an unsupported key, a value
    meshrl cannot honour), all reported together by `apply` with the recipe's own errors."""

    def __init__(self):
        super().__init__()
        self.problems: list[str] = []


def _meshrl_key(key: str) -> bool:
    from coordinator.recipe.config import RunConfig

    parts = tuple(key.split("."))
    return len(parts) > 1 and parts[-1] in keys_beside(RunConfig, parts)


def _unsupported(keys: list[str], raw: dict[str, str]) -> list[str]:
    """One line per key near a supported one (or that is a meshrl key written verl's way), one for the rest."""
    lines, rest = [], []
    for key in keys:
        near = did_you_mean(key, VERL_KEYS, cutoff=0.85)
        if _meshrl_key(key):
            near = f" (a meshrl key: write it --{key} {raw[key]})"
        (lines.append(f"{key}: verl key that meshrl does not support{near}") if near else rest.append(key))
    if rest:
        lines.append(f"{', '.join(rest)}: verl key{'s' if len(rest) > 1 else ''} that meshrl does not support "
                     f"(docs/from_verl.md lists the ones it does; meshrl's own keys go as --section.key value)")
    return lines


def parse(words: list[str]) -> VerlArgs:
    """verl key -> parsed value; `+key=` and `++key=` (Hydra's add / add-or-override) are the key itself. Every
    word meshrl cannot take is kept in `problems`, so one message names them all."""
    out, unknown, raw_values = VerlArgs(), [], {}
    for word in words:
        if word.startswith("~"):
            out.problems.append(f"{word}: Hydra's key deletion has no meaning in meshrl (leave the key out)")
            continue
        key, _, raw = word.partition("=")
        key = key.lstrip("+")
        if key not in VERL_KEYS:
            unknown.append(key)
            raw_values[key] = raw
            continue
        try:
            value = _value(raw)
            out[key] = None if value is None else VERL_KEYS[key].parse(key, value)
        except ValueError as e:
            out.problems.append(str(e) if str(e).startswith(key) else f"{key}={raw}: {e}")
    out.problems[:0] = _unsupported(unknown, raw_values)
    return out


def _renamed(err: ValueError, targets: list[tuple[str, str]]) -> ValueError:
    """A config error that names a meshrl key a verl key set names the verl key, the user's own."""
    msg = str(err)
    for verl_key, target in targets:
        if verl_key != target:
            msg = msg.replace(f"{target}:", f"{verl_key} (meshrl {target}):")
    return ValueError(msg)


def apply(given: dict[str, Any], load: Callable[[dict], Any]) -> tuple[dict, Any]:
    """The recipe keys that the verl values set (nested, typed) and the run config loaded with them;
    `load(data)` builds the config from the recipe with `data` merged over it. The words `parse` refused and the
    recipe's own errors make one ValueError."""
    problems = list(getattr(given, "problems", []))
    direct = {VERL_KEYS[k].target: v for k, v in given.items() if VERL_KEYS[k].target}
    targets = [(k, VERL_KEYS[k].target) for k in given if VERL_KEYS[k].target]
    if "custom_reward_function.name" in given:   # a name without its file: the error names verl's path key
        targets.append(("custom_reward_function.path", "reward.custom_function.path"))
    data = nest_overrides(direct)
    try:
        cfg = load(data)
        derived: dict[str, Any] = {}
        for key, value in given.items():
            if VERL_KEYS[key].resolve is not None and value is not None:
                keys = VERL_KEYS[key].resolve(value, cfg, given)
                targets += [(key, t) for t in keys]
                derived.update(keys)
        if derived:
            data = deep_merge(data, nest_overrides(derived))
            cfg = load(data)
    except ValueError as e:
        raise ValueError("; ".join([*problems, str(_renamed(e, targets))])) from None
    if problems:
        raise ValueError("; ".join(problems))
    return data, cfg


def user_keys(given: dict[str, Any], cfg) -> dict[str, str]:
    """meshrl key -> the verl key that set it, so a later check's error names the key the user typed."""
    names = {VERL_KEYS[k].target: k for k in given if VERL_KEYS[k].target}
    for key, value in given.items():
        if VERL_KEYS[key].resolve is not None and value is not None:
            try:
                names.update({target: key for target in VERL_KEYS[key].resolve(value, cfg, given)})
            except ValueError:
                pass  # apply already took this value
    if "custom_reward_function.path" in given:   # the component it becomes, as the reward config names it
        names.setdefault("reward.custom_function.name", "custom_reward_function.name")
    return names


def renamed(err: ValueError, names: dict[str, str]) -> ValueError:
    return _renamed(err, [(verl_key, target) for target, verl_key in names.items()])


# The forms a recipe's reward takes; one given on the command line replaces the recipe's, whichever it has, as
# verl's command line replaces its config's value. verl's custom_reward_function scores every data source, so it
# replaces reward.by_data_source as well.
REWARD_FORMS = ("components", "function", "custom_function")


def _reward_override(given: dict[str, Any], overrides: dict[str, Any]) -> tuple[str, str] | None:
    """(the key the user typed, the reward form it sets), for a command line that sets the reward."""
    if "custom_reward_function.path" in given:
        return "custom_reward_function", "custom_function"
    for key in overrides:
        section, _, rest = key.partition(".")
        if section == "reward" and rest.split(".")[0] in REWARD_FORMS:
            return f"--{key}", rest.split(".")[0]
    return None


def replaced(recipe: dict, given: dict[str, Any], overrides: dict[str, Any] | None = None) -> tuple[dict, list[str]]:
    """The recipe without the keys a command-line override replaces, and one line per replacement for the
    console (`custom_reward_function replaces the recipe's reward.components`)."""
    found = _reward_override(given, overrides or {})
    reward = recipe.get("reward")
    if found is None or not isinstance(reward, dict):
        return recipe, []
    who, form = found
    gone = [k for k in REWARD_FORMS if k != form and k in reward]
    if who == "custom_reward_function" and "by_data_source" in reward:
        gone.append("by_data_source")
    if not gone:
        return recipe, []
    out = {**recipe, "reward": {k: v for k, v in reward.items() if k not in gone}}
    return out, [f"{who} replaces the recipe's " + ", ".join(f"reward.{k}" for k in gone)]
