"""The `meshrl` command: serve a role, bring a whole mesh up, drive and watch runs, plot metrics."""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
import yaml
from rich.console import Console

if TYPE_CHECKING:
    from services.common.channel import ClientTLS

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="meshrl: RL post-training (PPO, GRPO, RLOO, REINFORCE++, DPO) as a mesh of gRPC services.")
console = Console()

ROLES = {"coordinator": "coordinator.__main__", "trainer": "services.trainer.__main__",
         "rollout": "services.rollout.__main__", "reward": "services.reward.__main__",
         "reference": "services.reference.__main__", "env": "services.env.__main__"}
DEFAULT_COORDINATOR = os.environ.get("MESHRL_COORDINATOR", "127.0.0.1:50050")
# How long `meshrl up`'s pools wait for a restarting replica (the supervisor's back-off, 1 + 2 + 4 s, plus a
# model load) before a call fails.
REJOIN_WAIT_S = 60.0
# Agent loops that call the env role (tools, environments): `meshrl up` starts an env replica for them.
ENV_AGENTS = ("tool_agent", "env_agent")
PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}

# gRPC statuses that say the user's input (a config, a run id, a token) is wrong: exit 2, like a config error.
# Any other status (UNAVAILABLE, INTERNAL, DEADLINE_EXCEEDED, ...) is a failure of the system: exit 1.
INPUT_STATUSES = frozenset({"INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS", "OUT_OF_RANGE", "FAILED_PRECONDITION",
                            "UNAUTHENTICATED", "PERMISSION_DENIED"})
_options = {"debug": False}


@app.callback()
def _global_options(debug: bool = typer.Option(False, "--debug", envvar="MESHRL_DEBUG",
                                               help="print the traceback of an error, not just its line")):
    _options["debug"] = debug


def error_line(e: Exception) -> tuple[str, int]:
    """An error as the one line a user sees, and the exit code: 2 for bad input, 1 for a failure of the system."""
    import grpc

    if isinstance(e, grpc.RpcError) and callable(getattr(e, "code", None)):
        code = e.code().name
        line, exit_code = f"{code}: {e.details() or ''}".rstrip(), 2 if code in INPUT_STATUSES else 1
    elif isinstance(e, ValueError):   # config errors and the checks before anything starts
        line, exit_code = str(e), 2
    elif isinstance(e, RuntimeError):  # a service that died, or did not start (coordinator/launcher.py)
        line, exit_code = str(e), 1
    else:
        line, exit_code = f"{type(e).__name__}: {e} (--debug prints the traceback)", 1
    return " ".join(line.split("\n")), exit_code


def command(name: str | None = None, **kwargs):
    """app.command whose errors end the command with one line `meshrl NAME: ...` on stderr and the exit code
    of error_line; `--debug` prints the traceback first. The one place exceptions meet the user."""
    def register(fn):
        cmd = name or fn.__name__

        @functools.wraps(fn)
        def wrapper(*args, **kw):
            try:
                return fn(*args, **kw)
            except (typer.Exit, typer.Abort, typer.TyperException):  # typer's own: exit codes, usage errors
                raise
            except KeyboardInterrupt:
                typer.echo(f"meshrl {cmd}: interrupted", err=True)
                raise typer.Exit(130) from None
            except Exception as e:  # noqa: BLE001 - every error becomes its line and exit code here
                if _options["debug"]:
                    traceback.print_exc()
                line, exit_code = error_line(e)
                typer.echo(f"meshrl {cmd}: {line}", err=True)
                raise typer.Exit(exit_code) from None
        return app.command(name, **kwargs)(wrapper)
    return register


# The options of every command that calls a running coordinator, with the environment variables the services
# read for the same thing (services/common/config.py ServerConfig: tls_ca, tls_client_cert, ...).
CONNECTION = {
    "coordinator": (str, typer.Option(DEFAULT_COORDINATOR, "--coordinator",
                                      help="coordinator address (env MESHRL_COORDINATOR)")),
    "token": (Optional[str], typer.Option(None, "--token", envvar="MESHRL_SERVER__AUTH_TOKEN", help="bearer token")),
    "tls_ca": (Optional[str], typer.Option(None, "--tls-ca", envvar="MESHRL_SERVER__TLS_CA",
                                           help="speak TLS, trusting this CA's PEM for the coordinator")),
    "tls_cert": (Optional[str], typer.Option(None, "--tls-cert", envvar="MESHRL_SERVER__TLS_CLIENT_CERT",
                                             help="client certificate PEM (mutual TLS)")),
    "tls_key": (Optional[str], typer.Option(None, "--tls-key", envvar="MESHRL_SERVER__TLS_CLIENT_KEY",
                                            help="client key PEM (mutual TLS)")),
    "tls_server_name": (Optional[str], typer.Option(None, "--tls-server-name",
                                                    envvar="MESHRL_SERVER__TLS_SERVER_NAME",
                                                    help="name in the coordinator's certificate, if not its host")),
}


def client_tls(tls_ca: str | None, tls_cert: str | None, tls_key: str | None, tls_server_name: str | None,
               ctx: typer.Context | None = None):
    """The ClientTLS of the connection options (None: plaintext); a setting that cannot be used is refused by the
    name the user gave it: its flag, or its environment variable when it came from there."""
    from services.common.channel import ClientTLS, read_pem

    def _source_name(param: str) -> str:
        info = CONNECTION[param][1]
        source = ctx.get_parameter_source(param) if ctx is not None else None
        return info.envvar if source is not None and source.name == "ENVIRONMENT" else info.param_decls[0]

    if bool(tls_cert) != bool(tls_key):
        raise ValueError(f"{_source_name('tls_cert')} and {_source_name('tls_key')}: set both or neither")
    if not tls_ca:
        given = next((p for p, v in (("tls_cert", tls_cert), ("tls_server_name", tls_server_name)) if v), None)
        if given:
            raise ValueError(f"{_source_name(given)}: needs {_source_name('tls_ca')} as well (TLS trusts the CA "
                             f"that signs the coordinator's certificate)")
        return None
    return ClientTLS(read_pem(tls_ca, _source_name("tls_ca")), read_pem(tls_key, _source_name("tls_key")),
                     read_pem(tls_cert, _source_name("tls_cert")), tls_server_name)


@dataclass
class Connection:
    """Where a command's coordinator is and how to reach it (token, TLS)."""

    address: str
    token: str | None = None
    tls: ClientTLS | None = None  # None = plaintext

    def client(self):
        from coordinator.client import Client

        return Client(self.address, token=self.token, tls=self.tls)


def connects(fn):
    """Gives a command the CONNECTION options; it receives them as one `conn: Connection` keyword."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.name not in ("conn", "ctx")]
    params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=kind)
               for name, (kind, info) in CONNECTION.items()]
    params.append(inspect.Parameter("connection_ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context))

    @functools.wraps(fn)
    def wrapper(*args, **kw):
        opts = {name: kw.pop(name) for name in CONNECTION}
        ctx = kw.pop("connection_ctx")
        tls = client_tls(opts["tls_ca"], opts["tls_cert"], opts["tls_key"], opts["tls_server_name"], ctx)
        if "ctx" in sig.parameters:  # a command that reads its extra words (`meshrl run`'s overrides)
            kw["ctx"] = ctx
        return fn(*args, **kw, conn=Connection(opts["coordinator"], opts["token"], tls))

    wrapper.__signature__ = sig.replace(parameters=params)
    wrapper.__annotations__ = {**{k: v for k, v in fn.__annotations__.items() if k not in ("conn", "ctx")},
                               **{name: kind for name, (kind, _) in CONNECTION.items()},
                               "connection_ctx": typer.Context}
    return wrapper


@command(context_settings=PASSTHROUGH)
def serve(ctx: typer.Context,
          role: str = typer.Argument(..., help="coordinator, trainer, rollout, reward, reference, env")):
    """Run one service: `meshrl serve rollout --config FILE [--port N] [--section.key value ...]`."""
    if role not in ROLES:
        raise typer.BadParameter(f"unknown role {role!r}; expected one of {', '.join(ROLES)}", param_hint="ROLE")
    importlib.import_module(ROLES[role]).main(list(ctx.args))


def _overrides(args: list[str]) -> dict[str, str]:
    from services.common.launch import parse_dotted_flags

    try:
        return parse_dotted_flags(args)
    except SystemExit as e:  # the services' parser exits; here a bad flag is bad input like any other (exit 2)
        raise ValueError(str(e)) from None


def _recipe_args(args: list[str]) -> tuple[dict, dict[str, str]]:
    """The words after a recipe: verl's `key=value` overrides (parsed, coordinator/verl_keys.py) and meshrl's
    `--section.key value` flags."""
    from coordinator import verl_keys

    verl, flags = verl_keys.split_args(args)
    return verl_keys.parse(verl), _overrides(flags)


def _load_recipe(config: Path, verl: dict, overrides: dict[str, str]):
    """The recipe with the verl keys' values merged in (a dict, as a service reads it) and its run config;
    meshrl's flags win over both."""
    from coordinator import verl_keys
    from coordinator.config import RunConfig
    from services.common.config import deep_merge, load_config, read_yaml

    data, cfg = verl_keys.apply(verl, lambda d: load_config(RunConfig, config, data=d, overrides=overrides))
    return deep_merge(read_yaml(config), data), cfg


def _write_private(path: Path, data: dict) -> Path:
    """A recipe file only its owner reads (it may carry the auth token)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    path.chmod(0o600)
    return path


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def step_line(m: dict, num_steps: int) -> str:
    if "dpo/loss" in m:
        return (f"step {int(m['step']):>3}/{num_steps}  dpo loss {_fmt(m.get('dpo/loss'))}  "
                f"margin {_fmt(m.get('dpo/rewards/margins'))}  pref acc {_fmt(m.get('dpo/rewards/accuracy'))}  "
                f"logp chosen {_fmt(m.get('dpo/logps/chosen'), '.2f')} rejected {_fmt(m.get('dpo/logps/rejected'), '.2f')}  "
                f"{_fmt(m.get('time/step'), '.2f')}s")
    return (f"step {int(m['step']):>3}/{num_steps}  reward {_fmt(m.get('reward_mean'))}  "
            f"acc {_fmt(m.get('accuracy'))}  kl {_fmt(m.get('kl'), '.4f')}  "
            f"entropy {_fmt(m.get('actor/entropy'))}  len {_fmt(m.get('response_length_mean'), '.1f')}  "
            f"{_fmt(m.get('time/step'), '.2f')}s")


@command(context_settings=PASSTHROUGH)
def up(ctx: typer.Context, config: Path = typer.Argument(..., dir_okay=False, help="recipe YAML"),
       run_dir: Optional[Path] = typer.Option(None, help="where run directories go (default: run.run_dir)"),
       threads: int = typer.Option(1, help="OMP threads per service process")):
    """Start every service as a process on 127.0.0.1, run the recipe to the end, stop everything.
    After the recipe: verl's overrides (`data.train_files=[a.parquet] actor_rollout_ref.rollout.n=8`,
    docs/from_verl.md) and meshrl's `--section.key value`."""
    from coordinator.launcher import Launcher
    from coordinator.preflight import check_run
    from services.common.channel import ClientTLS

    verl, overrides = _recipe_args(list(ctx.args))
    if run_dir is not None:
        overrides["run.run_dir"] = str(run_dir)
    # Everything that can be checked is checked before the first process starts: a config that was going to
    # fail wastes no service start.
    raw, cfg = _load_recipe(config, verl, overrides)
    check_run(cfg, world_size=cfg.trainer.nproc_per_node)
    placement, trainer_devices = _placement(cfg, raw, overrides)
    log_dir = Path(cfg.run.run_dir) / "logs" / time.strftime("%Y%m%d-%H%M%S")
    if verl:  # every service reads the recipe with the verl keys' values in it
        config = _write_private(log_dir / "recipe.yaml", raw)
    # The launcher calls its coordinator as the services call each other: the recipe's token and client TLS.
    conn = Connection("", cfg.server.auth_token.get_secret_value() if cfg.server.auth_token else None,
                      ClientTLS.from_server_config(cfg.server))
    with Launcher(str(config), log_dir=log_dir, overrides=overrides, num_threads=threads) as launcher:
        addresses = _start_mesh(launcher, cfg, raw, overrides, placement, trainer_devices)
        console.print(f"mesh up: {json.dumps(addresses)} (logs in {log_dir})", highlight=False, soft_wrap=True)
        conn.address = addresses["coordinator"][0]
        status = _drive(launcher, _with_addresses(raw, overrides, addresses), conn, cfg.run.num_steps)
    _report(status.run_dir)
    _print_result(status)
    if status.state != "COMPLETED":
        raise typer.Exit(1)


def _start_mesh(launcher, cfg, raw: dict, overrides: dict[str, str], placement: dict[str, list[str]],
                trainer_devices: str) -> dict[str, list[str]]:
    """Starts the trainer, every replica, then the coordinator; returns each role's addresses once all serve.

    Env replicas serve first: the rollout replicas, whose episode loops call them, start with their addresses
    (`env.servers` in a recipe file of their own, which a restarted rollout replica reads again)."""
    children = [launcher.start("trainer", nproc=cfg.trainer.nproc_per_node, devices=trainer_devices)]
    for role, devices in placement.items():
        if role != "rollout":
            children += [launcher.start(role, i, devices=d) for i, d in enumerate(devices)]
    env = [launcher.wait_ready(c) for c in children if c.role == "env"]
    rollout_args = []
    if env:
        own = _write_private(launcher.log_dir / "rollout.yaml", _with_addresses(raw, overrides, {"env": env}))
        rollout_args = ["--config", str(own)]
    children += [launcher.start("rollout", i, devices=d, extra_args=rollout_args)
                 for i, d in enumerate(placement.get("rollout", []))]
    addresses: dict[str, list[str]] = {}
    for c in children:
        addresses.setdefault(c.role, []).append(c.address or launcher.wait_ready(c))
    # The coordinator reads the recipe with the replicas' addresses filled in: they are its default pools
    # (ListServices with no run id, `meshrl services`). The later --config wins over the launcher's.
    own = _write_private(launcher.log_dir / "coordinator.yaml", _with_addresses(raw, overrides, addresses))
    coordinator = launcher.start("coordinator", extra_args=["--config", str(own)])
    return {**addresses, "coordinator": [launcher.wait_ready(coordinator)]}


def _drive(launcher, data: dict, conn: Connection, num_steps: int):
    """Starts the run on the coordinator and follows it to the end; returns its final status."""
    with conn.client() as client:
        run_id = client.start_run(yaml.safe_dump(data, sort_keys=False))
        console.print(f"run {run_id} started")
        _follow_while_alive(launcher, client, run_id, num_steps)
        return client.get_run(run_id)


def _placement(cfg, raw: dict, overrides: dict[str, str]) -> tuple[dict[str, list[str]], str]:
    """The GPUs of each replica by role, and the trainer's (all its ranks'); ValueError names a bad `devices:`."""
    from coordinator.launcher import replica_devices

    # Two rollout replicas unless the recipe or a flag says how many.
    asked = "replicas" in (raw.get("rollout") or {}) or "rollout.replicas" in overrides
    num_rollout = cfg.rollout.replicas if asked else 2
    num_reference = cfg.reference.replicas if (cfg.reference.replicas or cfg.needs_reference) else 0
    counts = {"reference": num_reference, "reward": max(1, cfg.reward.replicas), "rollout": num_rollout,
              "env": env_replicas(cfg, raw, overrides)}
    placement = {role: replica_devices(getattr(cfg, role).devices, n, role) for role, n in counts.items()}
    trainer_devices = replica_devices(cfg.trainer.devices, 1, "trainer")[0]  # whole: ranks use LOCAL_RANK
    listed = len(trainer_devices.split(",")) if trainer_devices else 0
    if 0 < listed < cfg.trainer.nproc_per_node:
        raise ValueError(f"trainer.devices: {listed} GPU(s) (\"{trainer_devices}\") for trainer.nproc_per_node="
                         f"{cfg.trainer.nproc_per_node} ranks; each rank needs its own GPU (LOCAL_RANK)")
    return placement, trainer_devices


def _with_addresses(raw: dict, overrides: dict[str, str], addresses: dict[str, list[str]]) -> dict:
    from services.common.config import deep_merge, nest_overrides

    data = deep_merge(raw, nest_overrides(overrides))
    for role in ("rollout", "reward", "reference", "env"):
        if addresses.get(role):
            data.setdefault(role, {})
            data[role]["servers"] = addresses[role]
            # A replica that dies is restarted (coordinator/supervisor.py): calls wait for it rather than fail
            # the step when it was the role's only one.
            data[role].setdefault("rejoin_wait_s", REJOIN_WAIT_S)
    if addresses.get("trainer"):
        data.setdefault("trainer", {})["address"] = addresses["trainer"][0]
    return data


def env_replicas(cfg, raw: dict, overrides: dict[str, str]) -> int:
    """How many env replicas `meshrl up` starts: `env.replicas` when the recipe (or a flag) has an `env:` section,
    one when only the agent loop calls tools or an environment (it needs a replica that hosts them), else none. A
    section that names running replicas (`env.servers` / `env.dns`) and asks for no count keeps to those."""
    from services.common.pools import configured
    from services.rollout.config import AGENT_ALIASES

    name = cfg.rollout.agent.name
    needed = AGENT_ALIASES.get(name, name) in ENV_AGENTS
    asked = "replicas" in (raw.get("env") or {}) or "env.replicas" in overrides
    if configured(cfg.env) and not asked:
        return 0
    if "env" in raw or any(key.startswith("env.") for key in overrides):
        if needed and cfg.env.replicas == 0 and not configured(cfg.env):
            raise ValueError(f"env.replicas: 0, and no env.servers or env.dns, but rollout.agent.name {name!r} "
                             f"calls the env role; start at least one replica or name running ones")
        return cfg.env.replicas
    return 1 if needed else 0


def _follow(client, run_id: str, num_steps: int) -> None:
    """One line per step above a live progress bar (reward, KL, throughput)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[stats]}"), console=console, transient=True) as progress:
        task = progress.add_task("run", total=num_steps, stats="")
        for m in client.stream_metrics(run_id):
            if "reward_mean" in m:
                progress.console.print(step_line(m, num_steps), highlight=False)
                stats = (f"margin {_fmt(m.get('reward_mean'))} {_fmt(m.get('pairs_per_s'), '.1f')} pairs/s"
                         if "dpo/loss" in m else
                         f"reward {_fmt(m.get('reward_mean'))} kl {_fmt(m.get('kl'), '.4f')} "
                         f"{_fmt(m.get('samples_per_s'), '.1f')} samples/s")
                progress.update(task, completed=int(m["step"]), stats=stats)
            if "heldout_accuracy" in m:   # a mid-run evaluation arrives in its step's record
                label = "after" if m.get("final") else ("before" if m["step"] == 0 else f"at step {m['step']}")
                line = f"held-out accuracy {label}: {m['heldout_accuracy']:.1%}"
                if "heldout_preference_accuracy" in m:
                    line += (f"  preference accuracy {m['heldout_preference_accuracy']:.1%}  "
                             f"margin {_fmt(m.get('heldout_reward_margin'))}")
                progress.console.print(line, highlight=False)


def _follow_while_alive(launcher, client, run_id: str, num_steps: int) -> None:
    """Follows the run while coordinator/supervisor.py restarts replicas that die; the loss of the coordinator,
    the trainer or every replica of a role ends `meshrl up` with the dead process's cause line, not a hang."""
    import threading

    from coordinator.supervisor import Supervisor

    supervisor = Supervisor(launcher, say=lambda line: console.print(line, highlight=False, soft_wrap=True))
    done = threading.Event()
    errors: list[BaseException] = []

    def follow():
        try:
            _follow(client, run_id, num_steps)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
        finally:
            done.set()

    threading.Thread(target=follow, daemon=True).start()
    while not done.wait(0.5):
        supervisor.check()
    if errors:
        raise errors[0]


def _report(run_dir: str) -> None:
    """report.png beside summary.json, and a short summary table."""
    from rich.table import Table

    from coordinator.report import plot_run

    path = Path(run_dir)
    if not (path / "metrics.jsonl").exists():
        return
    image = plot_run(path)
    summary_file = path / "summary.json"
    if summary_file.exists():
        summary = json.loads(summary_file.read_text())
        table = Table("steps", "seconds", "held-out before", "held-out after", "top phases")
        shares = sorted(summary["phase_time_shares"].items(), key=lambda kv: -kv[1])[:3]
        table.add_row(str(summary["steps"]), f"{summary['seconds']:.0f}",
                      f"{summary['heldout_accuracy_before']:.1%}", f"{summary['heldout_accuracy_after']:.1%}",
                      ", ".join(f"{k} {v:.0%}" for k, v in shares))
        console.print(table)
        if summary.get("algorithm") == "dpo":
            console.print(f"held-out preference accuracy {_fmt(summary.get('heldout_preference_accuracy_before'), '.1%')}"
                          f" -> {_fmt(summary.get('heldout_preference_accuracy_after'), '.1%')}", highlight=False)
    console.print(f"report: {image}")


def _print_result(status) -> None:
    before = status.last_metrics.get("heldout_accuracy_before")
    after = status.last_metrics.get("heldout_accuracy_after")
    console.print(f"run {status.run_id} {status.state} after {status.step} steps; metrics in {status.run_dir}"
                  + (f" ({status.message})" if status.message else ""), highlight=False)
    if before is not None and after is not None:
        console.print(f"held-out accuracy before {before:.1%} -> after {after:.1%} "
                      f"({(after - before) * 100:+.1f} points)", highlight=False)


@command(context_settings=PASSTHROUGH)
@connects
def run(ctx: typer.Context, config: Path = typer.Argument(..., dir_okay=False),
        follow: bool = typer.Option(True, help="stream metrics until the run ends"), *, conn: Connection):
    """Start a run on a running coordinator (services listed in the YAML). After the recipe: verl's
    overrides (`actor_rollout_ref.rollout.n=8`, docs/from_verl.md) and meshrl's `--section.key value`."""
    from coordinator.preflight import check_run
    from coordinator.run_settings import user_keys
    from services.common.config import deep_merge, nest_overrides

    # The config is checked here before anything is sent, as far as its own keys go; model folders, data files
    # and keys it leaves to the running services are checked by StartRun, on the coordinator's machine.
    verl, overrides = _recipe_args(list(ctx.args))
    raw, cfg = _load_recipe(config, verl, overrides)
    check_run(cfg, files="none", keys=set(user_keys(cfg)))
    text = (yaml.safe_dump(deep_merge(raw, nest_overrides(overrides)), sort_keys=False) if verl or overrides
            else config.read_text())
    with conn.client() as client:
        run_id = client.start_run(text)
        console.print(run_id)
        if follow:
            num_steps = client.get_run(run_id).num_steps
            _follow(client, run_id, num_steps)
            status = client.get_run(run_id)
            _print_result(status)
            if status.state != "COMPLETED":  # as `meshrl up`: a run that failed or was stopped is exit 1
                raise typer.Exit(1)


@command()
@connects
def status(run_id: Optional[str] = typer.Argument(None), *, conn: Connection):
    """Show one run, or every run the coordinator knows."""
    from rich.table import Table

    with conn.client() as client:
        runs = [client.get_run(run_id)] if run_id else client.list_runs()
    table = Table("run", "state", "step", "weight version", "data position", "reward", "message")
    for r in runs:
        table.add_row(r.run_id, r.state, f"{r.step}/{r.num_steps}", str(r.weight_version), str(r.data_position),
                      _fmt(r.last_metrics.get("reward_mean")), r.message)
    console.print(table)


@command()
@connects
def watch(run_id: str, once: bool = typer.Option(False, "--once", help="print the view once and exit"), *,
          conn: Connection):
    """Live view of a run: step, reward and accuracy sparklines, phase times, replicas and versions, last warning."""
    from coordinator.watch import watch_run

    with conn.client() as client:
        watch_run(client, run_id, once=once, console=console)


@command()
def trace(run: str = typer.Argument(..., help="run id (under --runs-dir) or run directory"),
          step: int = typer.Argument(..., help="the step whose trace to print"),
          runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="where run directories are (run.run_dir)")):
    """A step's trace (runs/<id>/traces.jsonl) as a tree with durations, its critical path marked."""
    from coordinator.traces import print_step
    print_step(run, step, runs_dir, console)


@command()
@connects
def stop(run_id: str, *, conn: Connection):
    """Stop a run after its current step."""
    with conn.client() as client:
        console.print(client.stop_run(run_id).state)


def command_line(status, asked: str) -> str:
    """What `meshrl pause` / `meshrl resume` print: the run's state now, or the step it pauses after."""
    at = f"{status.step}/{status.num_steps}"
    if asked == "pause" and status.state == "RUNNING":
        return f"run {status.run_id} pauses after its current step (steps done: {at}); `meshrl resume` continues it"
    return f"run {status.run_id} {status.state} at step {at}" + (f" ({status.message})" if status.message else "")


@command()
@connects
def pause(run_id: str, *, conn: Connection):
    """Pause a run after its current step; `meshrl resume RUN_ID` continues it."""
    with conn.client() as client:
        console.print(command_line(client.pause_run(run_id), "pause"), highlight=False)


@command()
@connects
def resume(run_id: str, *, conn: Connection):
    """Resume a paused run (one paused for a lost trainer reconnects, restoring its last checkpoint)."""
    with conn.client() as client:
        console.print(command_line(client.resume_run(run_id), "resume"), highlight=False)


@command()
@connects
def services(run_id: Optional[str] = typer.Argument(None, help="a run's pools (default: the coordinator's own)"), *,
             conn: Connection):
    """Replicas of every pool with health, weight version and load."""
    from rich.table import Table

    with conn.client() as client:
        replicas = client.list_services(run_id or "")
    table = Table("pool", "address", "healthy", "weight version", "load")
    for r in replicas:
        table.add_row(r.pool, r.address, "yes" if r.healthy else "no", str(r.weight_version), str(r.load))
    console.print(table)


@command()
def plot(run_dir: Path = typer.Argument(..., exists=True, file_okay=False),
         out: Optional[Path] = typer.Option(None, "--out", "-o", help="PNG path (default RUN_DIR/report.png)")):
    """PNG curves of reward, accuracy, KL, entropy, response length and the step-time breakdown."""
    from coordinator.report import plot_run

    path = plot_run(run_dir, out)
    console.print(str(path))


@command("profile-model")
def profile_model_cmd(model_path: str = typer.Argument(..., help="local Hugging Face model folder"),
                      seq_len: int = typer.Option(2048, help="sequence length for attention FLOPs"),
                      pp_size: int = typer.Option(1, help="pipeline stages to balance"),
                      as_json: bool = typer.Option(False, "--json", help="print JSON")):
    """Per-layer parameters and FLOPs, and a balanced pipeline stage split."""
    from rich.table import Table

    from services.common.profile_model import profile_model

    try:
        prof = profile_model(model_path, seq_len=seq_len, pp_size=pp_size)
    except OSError as e:  # a folder that holds no model is the user's input, like a ValueError
        raise ValueError(str(e)) from e
    if as_json:
        print(json.dumps(prof, indent=2))
        return
    table = Table("stage", "layers", "params", "train FLOPs share")
    for s in prof["stages"]:
        span = s["layers"][0] if len(s["layers"]) == 1 else f"{s['layers'][0]} .. {s['layers'][-1]}"
        table.add_row(str(s["stage"]), span, f"{s['params']:,}", f"{s['flops_share']:.1%}")
    console.print(table)
    console.print(f"{prof['total_params']:,} parameters; {prof['train_flops_per_token']:.3g} training FLOPs per "
                  f"token at seq_len {seq_len}", highlight=False)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
