"""Typed, validated configuration shared by every service: YAML file < MESHRL_* env < CLI flags.

One YAML file describes a whole run (sections `model`, `rollout`, `reward`, `reference`, `actor`,
`algorithm`, `data`, `run`, `server`, ...). Each service declares the sections it reads as a
`MeshSettings` subclass; sections reject unknown keys, so a typo fails with the key named.
"""

from __future__ import annotations

import contextvars
import difflib
import json
import types
import os
import re
from pathlib import Path
from typing import Any, Iterable, Literal, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

_YAML_DATA: contextvars.ContextVar[dict | None] = contextvars.ContextVar("meshrl_yaml_data", default=None)


class Section(BaseModel):
    """A config section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ServerConfig(Section):
    """How a service's gRPC server listens and authenticates."""

    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535, description="0 picks a free port")
    # Bearer token; every RPC but health and reflection needs it when set. Env: MESHRL_SERVER__AUTH_TOKEN.
    auth_token: SecretStr | None = None
    max_message_bytes: int = Field(256 * 1024 * 1024, ge=4 * 1024 * 1024)
    # Clients re-resolve DNS only when a connection drops, so connections are recycled periodically.
    max_connection_age_s: float = Field(300.0, gt=0)
    grace_seconds: float = Field(5.0, ge=0)
    # Deadline of outgoing calls made by this service (seconds).
    call_timeout_s: float = Field(600.0, gt=0)
    # Prometheus /metrics on this port (one per process; 0 picks a free one and logs it; None = off).
    metrics_port: int | None = Field(None, ge=0, le=65535)
    # Register this replica in the Redis service registry (TTL heartbeat) when set.
    registry_url: str = ""
    # Host others reach this replica at (default: host, or this machine's hostname when host is 0.0.0.0).
    advertise_host: str | None = None
    # TLS, as paths to PEM files. tls_cert + tls_key: this server speaks TLS only. tls_client_ca as well:
    # mutual TLS, every client must present a certificate signed by that CA.
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    # Calls this service makes (coordinator to pools and trainer, trainer to rollout): TLS when tls_ca is
    # set, verifying servers against it; presenting tls_client_cert/key (default tls_cert/key under mutual TLS).
    tls_ca: str | None = None
    tls_client_cert: str | None = None
    tls_client_key: str | None = None
    # Name the servers' certificates carry when it differs from the host dialled.
    tls_server_name: str | None = None

    @model_validator(mode="after")
    def _tls_pairs(self):
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key: set both or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca: mutual TLS needs tls_cert and tls_key as well")
        if bool(self.tls_client_cert) != bool(self.tls_client_key):
            raise ValueError("tls_client_cert and tls_client_key: set both or neither")
        return self


class ModelConfig(Section):
    """Which Hugging Face model folder to load and how."""

    path: str = "examples/arith/model"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"
    # OMP threads for CPU torch work; unset, step times vary 20x on small machines.
    num_threads: int = Field(1, ge=1)


class MeshSettings(BaseSettings):
    """Base of every service's settings: sections from YAML, overridden by env and CLI."""

    model_config = SettingsConfigDict(env_prefix="MESHRL_", env_nested_delimiter="__", extra="ignore")

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _YamlSource(settings_cls))


class _YamlSource(PydanticBaseSettingsSource):
    """Reads the parsed YAML that load_config put in the context variable."""

    def get_field_value(self, field, field_name):  # pragma: no cover - __call__ does the work
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_YAML_DATA.get() or {})


S = TypeVar("S", bound=MeshSettings)


def yaml_error(e: yaml.YAMLError) -> str:
    """PyYAML's error as one line: " line L, column C: problem" (its own text spans lines and quotes the source)."""
    mark = getattr(e, "problem_mark", None)
    where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    return f"{where}: {getattr(e, 'problem', None) or str(e).splitlines()[0]}"


def read_yaml(path: str | os.PathLike) -> dict:
    """Parses a YAML config file; errors name the file and line."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"config file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"config file {str(p)!r}{yaml_error(e)}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(p)!r}: top level must be a mapping of sections")
    return data


def settings_json(settings: BaseModel) -> str:
    """A service's settings as it started, for GetInfo's details["settings"]: every section but `server:` (where
    it listens), as JSON (secrets masked). The coordinator compares a run's keys fixed at start with these."""
    return json.dumps(settings.model_dump(mode="json", exclude={"server"}), sort_keys=True)


def did_you_mean(word: str, candidates, *, cutoff: float = 0.75) -> str:
    """` (did you mean 'x'?)` for the nearest candidate to a mistyped name (difflib), else ""."""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=cutoff)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _unwrap(tp: Any, part: Any) -> Any:
    """The type one step of a validation error's location leads to inside `tp` (a list index, a dict key, the
    model of an Optional)."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        models = [a for a in get_args(tp) if isinstance(a, type) and issubclass(a, BaseModel)]
        return _unwrap(models[0], part) if models else None
    if origin in (list, tuple, set):
        return get_args(tp)[0] if isinstance(part, int) else None
    if origin is dict:
        return get_args(tp)[1]
    if isinstance(tp, type) and issubclass(tp, BaseModel) and isinstance(part, str) and part in tp.model_fields:
        return tp.model_fields[part].annotation
    return None


def keys_beside(model: type[BaseModel] | None, loc: tuple) -> list[str]:
    """The keys a section at `loc[:-1]` of `model` has: what an unknown key at `loc` may have meant."""
    tp: Any = model
    for part in loc[:-1]:
        tp = _unwrap(tp, part)
    while get_origin(tp) in (Union, types.UnionType):
        tp = next((a for a in get_args(tp) if isinstance(a, type) and issubclass(a, BaseModel)), None)
    return list(tp.model_fields) if isinstance(tp, type) and issubclass(tp, BaseModel) else []


def format_validation_error(err: ValidationError, source: str = "config", *, section: str = "",
                            model: type[BaseModel] | None = None, flags: Iterable[str] = ()) -> str:
    """One line naming each bad key: `config: rollout.n: ...`; `section` goes in front of every key (a section
    validated on its own), an empty `source` leaves the prefix out. Every unknown key is listed, with the key of
    its section it was nearest to when `model` (the validated class) is given. A key set by a `--section.key`
    flag (`flags`) is named as that flag, and `source` (the file) is left out when no bad key came from it."""
    parts: list[str] = []
    union: dict[str, list[dict]] = {}          # a key's errors, one per member of its type's union (tags dropped)
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and _UNION_TAG.match(p)))
        key = _dotted([section, *loc] if section else loc) or "<root>"
        if len(loc) < len(e["loc"]):
            if key not in union:
                parts.append(key)               # its place: filled below with every member's expectation
            union.setdefault(key, []).append(e)
        elif e["type"] == "value_error" and "ctx" in e:
            parts.append(_keyed(key, str(e["ctx"]["error"])))
        elif e["type"] == "extra_forbidden":
            near = did_you_mean(str(e["loc"][-1]), keys_beside(model, e["loc"])) if e["loc"] else ""
            parts.append(f"{key}: unknown key{near}")
        else:
            parts.append(f"{key}: {e['msg']}")
    parts = [_union_error(p, union[p]) if p in union else p for p in parts]
    flagged = [any(p.startswith((f + ":", f + ".", f + "[")) for f in flags) for p in parts]
    parts = [f"--{p}" if by_flag else p for p, by_flag in zip(parts, flagged)]
    return f"{source}: " + "; ".join(parts) if source and not all(flagged) else "; ".join(parts)


# The location parts pydantic adds for a union's members (`literal['paged','none']`, `bool`, `int`,
# `function-after[...]`, a model's class name): not keys the user wrote.
_UNION_TAG = re.compile(r"^(?:[a-z][a-z-]*\[.*\]|bool|int|float|str|none|[A-Z]\w*)$")


def _union_error(key: str, errors: list[dict]) -> str:
    """One message for a value that matched no member of its key's union type: `rollout.kv_cache: should be 'paged'
    or 'none' or 'auto' (got 'pagd')`; a member's own complaint (a range, a custom check) is kept as it is."""
    wants = []
    for e in errors:
        msg = str(e["ctx"]["error"]) if e["type"] == "value_error" and "ctx" in e else e["msg"]
        msg = msg.removeprefix("Input should be ")
        msg = msg.split(", unable to")[0]
        if msg not in wants:
            wants.append(msg)
    got = errors[0].get("input")
    shown = f" (got {got!r})" if isinstance(got, (str, int, float, bool)) or got is None else ""
    return f"{key}: should be " + " or ".join(wants) + shown


def _dotted(loc) -> str:
    """A validation error's location as the user writes the key: `reward.components[0].name`."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def bool_choice(true: str | None, false: str | None):
    """A before-validator for a choice key that YAML or a flag may give as a boolean (`true`, `--x false`, YAML's
    `off`): true and false become the choices they stand for; one without a meaning stays, to be refused."""
    def convert(value: Any) -> Any:
        if isinstance(value, str) and value.lower() in ("true", "false"):
            value = value.lower() == "true"
        if isinstance(value, bool):
            return (true if value else false) or value
        return value
    return convert


def _keyed(key: str, msg: str) -> str:
    """A section validator's own message under its section's key, without pydantic's "Value error, ": one that
    names its whole key (`reward.components[1]: ...`) stays as it is, one that names a key inside the section
    (`total_steps: ...`) gets the section in front (`actor.total_steps: ...`)."""
    if msg.startswith(key + ".") or msg.startswith(key + "[") or msg.startswith(key + ":"):
        return msg
    head, colon, _ = msg.partition(": ")
    if colon and re.fullmatch(r"[A-Za-z_][\w.\[\]]*", head):
        return f"{key}.{msg}"
    return f"{key}: {msg}"


def nest_overrides(flat: dict[str, Any]) -> dict:
    """{'rollout.n': 4} -> {'rollout': {'n': 4}} (CLI flags are dotted section keys)."""
    out: dict = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {key!r}: {p!r} is not a section")
        node[leaf] = value
    return out


def deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(cls: type[S], path: str | os.PathLike | None = None, *, data: dict | None = None,
                overrides: dict[str, Any] | None = None, source: str | None = None) -> S:
    """Builds `cls` from a YAML file (or an already parsed dict), MESHRL_* env vars and dotted overrides.

    Raises ValueError naming the file (or `source`, where the parsed dict came from) and the bad key.
    """
    source = source or (str(path) if path else "config")
    yaml_data = read_yaml(path) if path else {}
    if data:
        yaml_data = deep_merge(yaml_data, data)
    token = _YAML_DATA.set(yaml_data)
    try:
        # pydantic-settings deep-merges the sources, so a dotted override replaces one key only.
        return cls(**nest_overrides(overrides or {}))
    except ValidationError as e:
        raise ValueError(format_validation_error(e, source, model=cls, flags=(overrides or {}).keys())) from None
    finally:
        _YAML_DATA.reset(token)


class PoolConfig(Section):
    """Keys every replicated role's section carries for the coordinator's replica pool.

    The service itself ignores them; they live in its section because users know `rollout.servers`.
    """

    # Static replica list (host:port); `meshrl up` fills it with the replicas it started.
    servers: list[str] = Field(default_factory=list)
    # A DNS name (host:port) that resolves to one address per replica (Kubernetes headless Service).
    dns: str | None = None
    # Discover replicas through the Redis registry (they register with a TTL heartbeat).
    registry: bool = False
    load_balancer: Literal["round_robin", "least_loaded"] = "round_robin"
    # Replicas `meshrl up` starts on this machine.
    replicas: int = Field(1, ge=0, le=64)
    # Deadline of one call to a replica, seconds.
    timeout_s: float = Field(300.0, gt=0)
    # Seconds a call waits for a replica to come back when none is healthy (a replica restarting); 0 fails the
    # call at once. `meshrl up`, which restarts a dead replica, makes it 60 unless the recipe sets it.
    rejoin_wait_s: float = Field(0.0, ge=0)
    # GPUs of this role's replicas (CUDA_VISIBLE_DEVICES), e.g. "4,5"; "" = inherit. `meshrl up` shares one
    # listed GPU among all replicas and splits several evenly (replicas 2, "4,5": one GPU each).
    devices: str = ""
