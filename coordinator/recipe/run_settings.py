"""Which config keys a run applies and which are fixed when a service starts, and what follows from that.

Every key of the RunConfig schema has a kind in SETTINGS:
- run: the run applies it on running services: it travels with each request (SamplingParams with every
  Generate, ActorLoss with every TrainActor), is set by ConfigureRun when the run opens (the trainer's
  optimizer hyperparameters, echoed back), or only the coordinator reads it (advantages, data, pools);
- fixed: a service reads it when it starts (model, dtype, mesh sizes, engine, reward components, ...); a run
  that sets a different value is refused with the key, the running value and the asked one;
- launch: only `meshrl up` (or the coordinator process) reads it, to start processes: where they listen, their
  GPUs, how many replicas; a run never reads it, whatever it says.

A fixed key is compared only when the run sets it (pydantic's model_fields_set): a run that leaves it out gets
the running service's value, and the effective config (GetRun, the run record) shows that value. Comparing
defaults instead would refuse every run that omits a key the services were started with (model.path of a
recipe's own model), which is the common case of a script that only changes the learning rate. Run keys a
service also holds from its start config (`held`: the optimizer's, sampling, reward components) follow the
same rule: left out, the service's start value applies, so the services' config is the runs' default.
"""

from __future__ import annotations

import asyncio
import json
import types
from dataclasses import dataclass, field
from typing import Any, Iterable, Union, get_args, get_origin

import grpc
import yaml
from google.protobuf import text_format
from pydantic import BaseModel, ValidationError

from coordinator.training import remote
from services.common.auto import parse as parse_resolved
from services.common.placement import pick_transport, placement_from
from coordinator.recipe.config import RunConfig
from coordinator.recipe.preflight import check_run
from services.common.config import format_validation_error
from services.reward.config import ComponentConfig
from services.rollout.config import AgentConfig
from services.reward.functions import REWARD_FUNCTIONS
from services.trainer.config import RUN_OPTIM_KEYS, RunOptim
from services.trainer.convert import run_optim_from_pb, run_optim_to_pb
from services.trainer.types import RunStart

RUN, FIXED, LAUNCH = "run", "fixed", "launch"
# The trainer's answers to a checkpoint it will not start a run from (damaged, missing, another model's).
REFUSED = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)


@dataclass(frozen=True)
class Setting:
    """The kind of a key, who reads it, and how a run's value reaches it."""

    kind: str
    owner: str
    how: str
    # A run key a running service also holds (from its start config): a run that leaves it out gets the
    # service's value, as it does for a fixed key.
    held: bool = False

    @property
    def from_service(self) -> bool:
        return self.kind == FIXED or self.held


SAMPLING_KEYS = ("n", "temperature", "top_p", "max_tokens", "stop", "seed")
POOL_KEYS = ("servers", "dns", "registry", "load_balancer", "timeout_s", "rejoin_wait_s")
POOLS = ("rollout", "reward", "reference")

_SAMPLING = Setting(RUN, "rollout", "SamplingParams of every Generate; left out: the replica's", held=True)
_OPTIM = Setting(RUN, "trainer", "ConfigureRun when the run opens or resumes (echoed back); left out: the "
                                 "trainer's start value", held=True)
_POOL = Setting(RUN, "coordinator", "the run's replica pool")
_AGENT = Setting(RUN, "rollout", "AgentSpec of every GenerateEpisodes (multi-turn episodes); left out: the "
                                 "replica's rollout.agent", held=True)
_PLACEMENT = Setting(LAUNCH, "meshrl up", "how many replicas it starts, on which GPUs")

# "section.key" entries win over their section's "section.*".
SETTINGS: dict[str, Setting] = {
    "model.*": Setting(FIXED, "trainer, rollout, reference", "loaded when the service starts"),
    "actor.*": Setting(FIXED, "trainer", "read when the trainer starts"),
    **{f"actor.{k}": _OPTIM for k in RUN_OPTIM_KEYS},
    "critic.*": Setting(FIXED, "trainer", "read when the trainer starts (a critic exists or not)"),
    **{f"critic.{k}": _OPTIM for k in RUN_OPTIM_KEYS},
    "weight_sync.*": Setting(FIXED, "trainer", "read when the trainer starts"),
    "rollout.*": Setting(FIXED, "rollout", "read when the replica starts"),
    **{f"rollout.{k}": _SAMPLING for k in SAMPLING_KEYS},
    **{f"rollout.agent.{k}": _AGENT for k in AgentConfig.model_fields},
    "rollout.partial_rollouts": Setting(RUN, "rollout", "GenerateRequest.partial_rollout and "
                                                        "GenerateEpisodesRequest.partial_rollout of the run's training "
                                                        "batches (async mode; every engine call of an episode)"),
    "reward.*": Setting(FIXED, "reward", "read when the replica starts (workers, user functions, models)"),
    "reward.components": Setting(RUN, "reward", "built-in rules travel with every Score request; a list that "
                                                "differs from a replica's and holds a reward model or a user "
                                                "function is refused (loaded when the replica starts); left "
                                                "out: the replica's", held=True),
    "reference.*": Setting(FIXED, "reference", "read when the replica starts"),
    "env.*": Setting(FIXED, "env, rollout", "the tools and sandbox when an env replica starts; the pool keys when a "
                                            "rollout replica starts (its episode loop calls the env replicas)"),
    **{f"env.{k}": _PLACEMENT for k in ("replicas", "devices")},
    **{f"{pool}.{k}": _POOL for pool in POOLS for k in POOL_KEYS},
    **{f"{pool}.{k}": _PLACEMENT for pool in POOLS for k in ("replicas", "devices")},
    "algorithm.*": Setting(RUN, "coordinator, trainer", "advantages and KL in the coordinator; loss settings with "
                                                        "every TrainActor/TrainCritic (ActorLoss, CriticLoss)"),
    "dpo.*": Setting(RUN, "coordinator, trainer", "pairs in the coordinator; DPOLoss with every TrainDPO"),
    "data.*": Setting(RUN, "coordinator", "the run's datasets"),
    "run.*": Setting(RUN, "coordinator", "the run's length, outputs, checkpoints, async mode"),
    **dict.fromkeys(("run.redis_url", "run.redis_prefix"),
                    Setting(LAUNCH, "coordinator, replicas", "the state store and service registry (keys under "
                                                             "redis_prefix), read at each process's start")),
    "trainer.*": Setting(LAUNCH, "meshrl up", "how many trainer ranks it starts, on which GPUs"),
    "trainer.address": Setting(RUN, "coordinator", "the trainer the run calls"),
    "trainer.timeout_s": Setting(RUN, "coordinator", "deadline of the run's trainer calls"),
    "coordinator.*": Setting(LAUNCH, "meshrl up / meshrl run", "where the coordinator listens"),
    "training_api.*": Setting(LAUNCH, "meshrl mesh", "the training API served beside the coordinator, read at its start"),
    "server.*": Setting(LAUNCH, "every service", "how each service's server listens, read at its start"),
    "server.auth_token": Setting(RUN, "coordinator", "the bearer token of the run's calls"),
}


def classify(key: str) -> Setting:
    """The setting of a dotted schema key; KeyError for a key no entry covers."""
    section = key.split(".", 1)[0]
    return SETTINGS.get(key) or SETTINGS[f"{section}.*"]


def _model_of(annotation) -> type[BaseModel] | None:
    """The pydantic model a field holds (unwrapping `X | None`), None for a leaf."""
    if get_origin(annotation) in (Union, types.UnionType):
        models = [a for a in get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        return models[0] if models else None
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def schema_keys(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    """Every leaf key of a config schema, dotted (`actor.lr`); lists and maps of sections are leaves."""
    keys = []
    for name, info in model.model_fields.items():
        sub = _model_of(info.annotation)
        keys += schema_keys(sub, f"{prefix}{name}.") if sub else [f"{prefix}{name}"]
    return keys


def user_keys(cfg: BaseModel, prefix: str = "") -> list[str]:
    """The leaf keys a config sets (YAML, env or flags), not the defaults it falls back on."""
    keys = []
    for name in sorted(cfg.model_fields_set):
        value = getattr(cfg, name)
        keys += user_keys(value, f"{prefix}{name}.") if isinstance(value, BaseModel) else [f"{prefix}{name}"]
    return keys


def settings_table() -> str:
    """The Markdown table of every key by section and kind, as docs/coordinator.md shows it."""
    groups: dict[tuple[str, Setting], list[str]] = {}
    for key in schema_keys():
        section, leaf = key.split(".", 1)
        groups.setdefault((section, classify(key)), []).append(leaf)
    lines = ["| section | kind | keys | read by: how a run's value reaches it |", "|---|---|---|---|"]
    for (section, setting), leaves in groups.items():
        keys = ", ".join(f"`{k}`" for k in leaves)
        lines.append(f"| `{section}` | {setting.kind} | {keys} | {setting.owner}: {setting.how} |")
    return "\n".join(lines)


_MISSING = object()

# Secret keys: never written to the run record nor shown by GetRun.
SECRETS = (("server", "auth_token"), ("rollout", "api_key"))


def value_at(tree: Any, key: str, default: Any = _MISSING) -> Any:
    """The value at a dotted key of nested dicts, `default` where the path ends early."""
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return default
        tree = tree[part]
    return tree


@dataclass
class Running:
    """A running service and the settings it started with (GetInfo's details["settings"])."""

    role: str
    address: str
    settings: dict
    # The rest of GetInfo's details (engine, weight_updates, ...).
    details: dict = field(default_factory=dict)

    @property
    def noun(self) -> str:
        return "trainer" if self.role == "trainer" else "replica"

    @property
    def name(self) -> str:
        return "trainer" if self.role == "trainer" else f"{self.role} replica {self.address}"


def _show(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def check_fixed(asked: dict[str, Any], running: Iterable[Running]) -> None:
    """ValueError for the first fixed key whose asked value differs from a running service's."""
    running = list(running)
    for key, value in asked.items():
        if classify(key).kind != FIXED:
            continue
        for svc in running:
            have = value_at(svc.settings, key)
            if have is not _MISSING and have != value:
                raise ValueError(f"{key}: the running {svc.name} has {_show(have)}, this run asks {_show(value)} "
                                 f"(set when the {svc.noun} starts; restart it to change)")


def _rules_only(components: list) -> bool:
    return all(c.get("function") is None and c["name"] in REWARD_FUNCTIONS for c in components)


def check_components(asked: dict[str, Any], running: Iterable[Running]) -> None:
    """reward.components travel with each Score request when they are built-in rules; a reward model or a
    user function is loaded when a replica starts, so a list holding one must be the replica's own."""
    value = asked.get("reward.components", _MISSING)
    for svc in running:
        have = value_at(svc.settings, "reward.components")
        if value is _MISSING or have is _MISSING or have == value or _rules_only(value):
            continue
        raise ValueError(f"reward.components: the running {svc.name} has {_show(have)}, this run asks "
                         f"{_show(value)} (reward models and user functions are loaded when the replica "
                         f"starts; restart it to change, or use built-in rules only)")


def score_components(cfg: RunConfig) -> list[ComponentConfig]:
    """The components a run sends with each Score request: its own when they are all built-in rules (the
    replica builds them), none otherwise (the replica's own list, which check_components held equal)."""
    components = cfg.reward.components
    return list(components) if all(c.function is None and not c.is_model for c in components) else []


def check_critic(cfg: RunConfig, running: Iterable[Running]) -> None:
    """A run with a `critic:` section needs a trainer started with one."""
    for svc in running:
        if svc.role == "trainer" and cfg.critic is not None and svc.settings.get("critic") is None:
            raise ValueError("critic: the running trainer has no critic, this run asks for one (set when the "
                             "trainer starts; restart it with a `critic:` section)")


def check_rollout_weights(cfg: RunConfig, running: Iterable[Running]) -> None:
    """An RL run pushes weights to every rollout replica after each step: a replica that cannot take them (an
    `openai` proxy of a server without weight-update endpoints) is refused before step 1. DPO never pushes."""
    if cfg.algorithm.kind != "rl":
        return
    for svc in running:
        if svc.role == "rollout" and svc.details.get("weight_updates") in ("none", "unknown"):
            raise ValueError(f"rollout.servers: replica {svc.address} proxies {svc.details.get('server_url')} "
                             f"(rollout.engine openai), which cannot take weight updates "
                             f"({svc.details.get('weight_updates_why')}); algorithm.kind rl "
                             f"({cfg.algorithm.adv_estimator}) trains on-policy and pushes weights every step. "
                             f"Serve vLLM's weight-update endpoints and set rollout.weights_dir, or use it for "
                             f"offline DPO or evaluation only")


# Shorthands for a component, already expanded into reward.components (and so never taken from a service).
SHORTHANDS = ("function", "custom_function")


def drop_shorthands(data: dict) -> None:
    for key in SHORTHANDS:
        data["reward"].pop(key, None)


def effective_data(cfg: RunConfig, running: Iterable[Running]) -> dict:
    """The run's config as plain data, with every fixed key it left out taken from the running services."""
    data = cfg.model_dump(mode="json")
    set_keys = set(user_keys(cfg))
    running = list(running)
    for key in schema_keys():
        if key in set_keys or not classify(key).from_service or key.split(".")[:2] == ["reward", "custom_function"]:
            continue
        for svc in running:
            have = value_at(svc.settings, key)
            if have is not _MISSING:
                # Nested sections (actor.lora.rank) are set at their own depth.
                *path, leaf = key.split(".")
                node = data
                for part in path:
                    if node.get(part) is None:
                        node[part] = {}
                    node = node[part]
                node[leaf] = have
                break
    trainer = next((s for s in running if s.role == "trainer"), None)
    if trainer is not None and cfg.critic is None and trainer.settings.get("critic") is not None:
        data["critic"] = trainer.settings["critic"]      # the trainer's critic trains with its own settings
    drop_shorthands(data)
    return data


def validated(data: dict, *, secrets_from: RunConfig) -> RunConfig:
    """A whole config from plain data (every key set), its secrets (never dumped) taken from `secrets_from`."""
    data = {section: dict(v) if isinstance(v, dict) else v for section, v in data.items()}
    for section, key in SECRETS:
        data[section].pop(key, None)
    try:
        # Init values (every key present) win over MESHRL_* env; the asked config already holds those.
        cfg = RunConfig(**data)
    except ValidationError as e:
        raise ValueError(format_validation_error(e, "effective config")) from None
    for section, key in SECRETS:
        setattr(getattr(cfg, section), key, getattr(getattr(secrets_from, section), key))
    return cfg


def effective_config(cfg: RunConfig, running: Iterable[Running]) -> RunConfig:
    """The config the run trains with: its own keys, and the running services' values of those it left out."""
    return validated(effective_data(cfg, running), secrets_from=cfg)


def config_text(cfg: RunConfig) -> str:
    """The effective config as the YAML that GetRun shows and the run record stores (secrets left out)."""
    data = cfg.model_dump(mode="json", exclude={section: {key} for section, key in SECRETS})
    drop_shorthands(data)
    return yaml.safe_dump(data, sort_keys=False)


def resolved_choices(running: Iterable[Running]) -> dict[str, list[tuple[str, dict]]]:
    """Every `auto` key the running services resolved: {key: [(service name, {value, asked, why}), ...]}, with
    weight_sync.transport per rollout replica by the rule the trainer's AutoSender follows."""
    out: dict[str, list[tuple[str, dict]]] = {}
    running = list(running)
    for svc in running:
        for key, choice in parse_resolved(svc.details).items():
            if "[" not in key and not (key == "weight_sync.transport" and choice.get("asked") == "auto"):
                out.setdefault(key, []).append((svc.name, choice))
    trainer = next((s for s in running if s.role == "trainer"), None)
    asked = value_at(trainer.settings, "weight_sync.transport") if trainer is not None else _MISSING
    if trainer is not None and asked in ("auto", None):
        here = placement_from(trainer.details)
        for svc in running:
            if svc.role == "rollout":
                value, why = pick_transport(here, placement_from(svc.details), nccl_here="nccl" in here.transports)
                out.setdefault("weight_sync.transport", []).append(
                    (svc.name, {"value": value, "asked": "auto", "why": why}))
    return out


def resolved_recipe(cfg: RunConfig, running: Iterable[Running]) -> str:
    """The run's recipe.yaml: its effective config with each `auto` key the services resolved written as the value
    they chose (kept `auto` where replicas chose differently), under a comment that says what and why. Run again
    as is, it asks for exactly those values."""
    data = yaml.safe_load(config_text(cfg))
    lines = ["# The effective config of this run. Keys that were `auto` hold what the services resolved them to:"]
    for key, choices in resolved_choices(running).items():
        values = {json.dumps(c.get("value")) for _, c in choices}
        grouped: dict[tuple, list[str]] = {}
        for name, c in choices:
            grouped.setdefault((c.get("asked"), _plain(c.get("value")), c.get("why")), []).append(name)
        for (asked, value, why), names in grouped.items():
            lines.append(f"#   {key}: {asked} -> {value} on the {', '.join(names)} ({why})")
        *path, leaf = key.split(".")
        node = data
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if len(values) == 1 and isinstance(node, dict) and leaf in node and node[leaf] in ("auto", None) \
                and choices[0][1].get("asked") == "auto":
            node[leaf] = choices[0][1].get("value")
    return "\n".join(lines) + "\n" + yaml.safe_dump(data, sort_keys=False)


def _plain(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


async def _report(role: str, address: str, stub) -> Running:
    info = await remote.info(stub)
    text = info.details.get("settings")
    if text is None:
        key = "trainer.address" if role == "trainer" else f"{role}.servers"
        raise ValueError(f"{key}: the {role} at {address} does not report its settings (GetInfo "
                         f"details['settings']); it is older than this coordinator")
    return Running(role, address, json.loads(text), dict(info.details))


async def running_services(trainer, trainer_address: str, pools) -> list[Running]:
    """The start settings of the trainer and of every healthy replica of the run's pools."""
    calls = [_report("trainer", trainer_address, trainer)]
    for pool in pools:
        if pool is not None:
            calls += [_report(pool.role, rep.address, rep.stub) for rep in pool.healthy()]
    return list(await asyncio.gather(*calls))


async def configure_trainer(trainer, cfg: RunConfig, *, reset_schedule: bool,
                            start: RunStart | None = None) -> RunOptim:
    """Sets the run's optimizer settings on the trainer (after its starting weights, given `start`); RuntimeError
    when its answer differs from them. A checkpoint the trainer refuses is refused as the run's run.init_from."""
    request = run_optim_to_pb(RunOptim(cfg.actor, cfg.critic, reset_schedule=reset_schedule, start=start))
    try:
        answer = await trainer.ConfigureRun(request)
    except grpc.aio.AioRpcError as e:
        if start is None or not start.checkpoint or e.code() not in REFUSED:
            raise
        raise ValueError(f"run.init_from: the trainer refused checkpoint {start.checkpoint}: {e.details()}") from None
    for name in ("actor", "critic"):      # compared as sent: the run's keys, through one converter both ways
        want, got = (getattr(m, name) if m.HasField(name) else None for m in (request, answer))
        if want != got:
            said = [text_format.MessageToString(m, as_one_line=True) if m is not None else None for m in (got, want)]
            raise RuntimeError(f"{name}: the trainer applied {said[0]}, not the run's {said[1]}")
    return run_optim_from_pb(answer)


async def settle(cfg: RunConfig, pools, trainer, trainer_address: str, *, recorded: dict | None = None,
                 resume: bool = False, seen: list[Running] | None = None, start: RunStart | None = None,
                 applied: list[RunOptim] | None = None) -> RunConfig:
    """Checks a run's fixed keys against the running services and configures the trainer for it; returns the
    effective config. At a resume, `recorded` (the run's effective config as first recorded) is compared key
    by key, so a service restarted with other settings is refused; otherwise the keys the run sets are.
    `start` (a run that starts, never one that resumes): the weights it starts from. `seen`, when given, receives
    the running services that were asked; `applied`, the trainer's answer."""
    running = await running_services(trainer, trainer_address, pools)
    if seen is not None:
        seen.extend(running)
    if recorded is not None:
        cfg = validated(recorded, secrets_from=cfg)     # every key set: all are held to the record
    dump = cfg.model_dump(mode="json")
    asked = {k: value_at(dump, k) for k in user_keys(cfg)}
    check_fixed(asked, running)
    check_components(asked, running)
    check_critic(cfg, running)
    check_rollout_weights(cfg, running)
    effective = effective_config(cfg, running)
    check_run(effective, files="none")     # before the trainer is configured: nothing is half-applied
    answer = await configure_trainer(trainer, effective, reset_schedule=not resume, start=start)
    if applied is not None:
        applied.append(answer)
    return effective


if __name__ == "__main__":
    print(settings_table())
