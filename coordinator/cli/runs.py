"""`meshrl up` and `meshrl run`: load a recipe, start the mesh (up), start a run and follow it to its end."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Optional

import typer
import yaml

from coordinator.cli.common import (PASSTHROUGH, Connection, LostCoordinator, _fmt, command, connects, console,
                                   say)

# How long `meshrl up`'s pools wait for a restarting replica (the supervisor's back-off, 1 + 2 + 4 s, plus a
# model load) before a call fails.
REJOIN_WAIT_S = 60.0
# Agent loops that call the env role (tools, environments): `meshrl up` starts an env replica for them.
ENV_AGENTS = ("tool_agent", "env_agent")


def _overrides(args: list[str]) -> dict[str, str]:
    from services.common.rpc.launch import parse_dotted_flags

    try:
        return parse_dotted_flags(args)
    except SystemExit as e:  # the services' parser exits; here a bad flag is bad input like any other (exit 2)
        raise ValueError(str(e)) from None


def _recipe_args(args: list[str]) -> tuple[dict, dict[str, str]]:
    """The words after a recipe: verl's `key=value` overrides (parsed, coordinator/recipe/verl_keys.py) and meshrl's
    `--section.key value` flags."""
    from coordinator.recipe import verl_keys

    verl, flags = verl_keys.split_args(args)
    return verl_keys.parse(verl), _overrides(flags)


def _load_recipe(config: Path | None, verl: dict, overrides: dict[str, str]):
    """The recipe with the verl keys' values merged in (a dict, as a service reads it) and its run config;
    meshrl's flags win over both. No recipe: the defaults (`meshrl mesh` with none)."""
    from coordinator.recipe import verl_keys
    from coordinator.recipe.config import RunConfig
    from services.common.config import deep_merge, load_config, read_yaml

    # A command-line override replaces what it stands for in the recipe (custom_reward_function: its reward).
    recipe, notes = verl_keys.replaced(read_yaml(config) if config else {}, verl, overrides)
    data, cfg = verl_keys.apply(verl, lambda d: load_config(RunConfig, data=deep_merge(recipe, d),
                                                            overrides=overrides, source=str(config or "defaults")))
    for note in notes:
        console.print(note, highlight=False, soft_wrap=True)
    return deep_merge(recipe, data), cfg


def _write_private(path: Path, data: dict) -> Path:
    """A recipe file only its owner reads (it may carry the auth token)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    path.chmod(0o600)
    return path


def step_line(m: dict, num_steps: int) -> str:
    if "dpo/loss" in m:
        return (f"step {int(m['step']):>3}/{num_steps}  dpo loss {_fmt(m.get('dpo/loss'))}  "
                f"margin {_fmt(m.get('dpo/rewards/margins'))}  pref acc {_fmt(m.get('dpo/rewards/accuracy'))}  "
                f"logp chosen {_fmt(m.get('dpo/logps/chosen'), '.2f')} rejected {_fmt(m.get('dpo/logps/rejected'), '.2f')}  "
                f"{_fmt(m.get('time/step'), '.2f')}s")
    # algorithm.filter_groups: the generation batches the step made to fill its batch.
    gen = f"gen {int(m['train/num_gen_batches'])}  " if "train/num_gen_batches" in m else ""
    return (f"step {int(m['step']):>3}/{num_steps}  reward {_fmt(m.get('reward_mean'))}  "
            f"acc {_fmt(m.get('accuracy'))}  kl {_fmt(m.get('kl'), '.4f')}  "
            f"entropy {_fmt(m.get('actor/entropy'))}  len {_fmt(m.get('response_length_mean'), '.1f')}  "
            f"{gen}{_fmt(m.get('time/step'), '.2f')}s")


@command(context_settings=PASSTHROUGH)
def up(ctx: typer.Context, config: Path = typer.Argument(..., dir_okay=False, help="recipe YAML"),
       run_dir: Optional[Path] = typer.Option(None, help="where run directories go (default: run.run_dir)"),
       threads: int = typer.Option(1, help="OMP threads per service process"),
       resume: str = typer.Option("", "--resume", metavar="RUN_ID",
                                  help="continue this interrupted run (needs run.redis_url) instead of starting one"),
       stop_wait_s: float = typer.Option(120.0, help="on Ctrl-C or SIGTERM: how long the step in flight may take "
                                                     "to finish before every service stops")):
    """Start every service as a process on 127.0.0.1, run the recipe to the end, stop everything.
    After the recipe: verl's overrides (`data.train_files=[a.parquet] actor_rollout_ref.rollout.n=8`,
    docs/from_verl.md) and meshrl's `--section.key value`. Ctrl-C or SIGTERM: the step in flight finishes, the
    run is paused and checkpointed, and the `meshrl up --resume RUN_ID ...` line that continues it is printed."""
    from coordinator.cli.interrupt import sigterm_as_interrupt
    from coordinator.cli.launcher import Launcher
    from coordinator.recipe import verl_keys
    from coordinator.recipe.fits import check_recipe_fits, fitted_line
    from coordinator.recipe.preflight import check_run
    from services.common.rpc.channel import ClientTLS
    from services.common.config import read_yaml

    verl, overrides = _recipe_args(list(ctx.args))
    if run_dir is not None:
        overrides["run.run_dir"] = str(run_dir)
    # Everything that can be checked is checked before the first process starts: a config that was going to
    # fail wastes no service start.
    raw, cfg = _load_recipe(config, verl, overrides)
    check_run(cfg, world_size=cfg.trainer.nproc_per_node, names=verl_keys.user_keys(verl, cfg))
    if resume and not cfg.run.redis_url:
        raise ValueError("--resume: run.redis_url is not set; without it a run's record lives in the coordinator's "
                         "memory and ended with the `meshrl up` that ran it (set run.redis_url to make runs "
                         "resumable)")
    if resume:
        from coordinator.cli.interrupt import check_resumable

        check_resumable(cfg.run, resume)
    placement, trainer_devices = _placement(cfg, raw, overrides)
    # On a CUDA model.device: the services' estimated memory fits each GPU, or the recipe is refused here with
    # the estimate and the setting to change (coordinator/recipe/fits.py), not an out-of-memory error at step 3.
    if fitted := check_recipe_fits(cfg, placement, trainer_devices):
        overrides.update(fitted)     # every service reads it as a command-line setting
        say(fitted_line(fitted))
    log_dir = Path(cfg.run.run_dir) / "logs" / time.strftime("%Y%m%d-%H%M%S")
    if raw != read_yaml(config):  # every service reads the recipe with the verl keys' values in it and what
        # the command line replaced taken out
        config = _write_private(log_dir / "recipe.yaml", raw)
    # The launcher calls its coordinator as the services call each other: the recipe's token and client TLS.
    conn = Connection("", cfg.server.auth_token.get_secret_value() if cfg.server.auth_token else None,
                      ClientTLS.from_server_config(cfg.server))
    with Launcher(str(config), log_dir=log_dir, overrides=overrides, num_threads=threads) as launcher, \
            sigterm_as_interrupt():
        addresses = _start_mesh(launcher, cfg, raw, overrides, placement, trainer_devices)
        say(f"mesh up: {json.dumps(addresses)} (logs in {log_dir})")
        conn.address = addresses["coordinator"][0]
        status = _drive(launcher, _run_data(raw, overrides, addresses), conn, cfg, resume=resume,
                        stop_wait_s=stop_wait_s)
    _report(status.run_dir)
    _print_result(status)
    if status.state != "COMPLETED":
        raise typer.Exit(1)


def _start_mesh(launcher, cfg, raw: dict, overrides: dict[str, str], placement: dict[str, list[str]],
                trainer_devices: str, *, training_api: bool = False) -> dict[str, list[str]]:
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
    # `meshrl mesh`: the training API beside the coordinator, on the same trainer and replicas (docs/training_api.md).
    training = [launcher.start("training", extra_args=["--config", str(own)])] if training_api else []
    return {**addresses, "coordinator": [launcher.wait_ready(coordinator)],
            **({"training": [launcher.wait_ready(training[0])]} if training else {})}


def _drive(launcher, data: dict, conn: Connection, cfg, *, resume: str = "", stop_wait_s: float = 120.0):
    """Starts (or resumes) the run on the coordinator and follows it to the end; returns its final status. Ctrl-C
    or SIGTERM: the run is paused after its step in flight and checkpointed, and the resume command printed
    (coordinator/cli/interrupt.py), before the interrupt stops every service."""
    from coordinator.cli.interrupt import pause_for_exit, resume_line
    from coordinator.cli.launcher import ServiceFailed

    with conn.client() as client:
        run_id, from_step = _start_or_resume(client, data, resume)
        try:
            _follow_while_alive(launcher, client, run_id, cfg.run.num_steps, cfg.run.zero_variance_warn_steps,
                                from_step)
        except KeyboardInterrupt:
            resumable = bool(cfg.run.redis_url)
            status = pause_for_exit(client, run_id, stop_wait_s, say, checkpoint=resumable)
            say(resume_line(run_id, status, resumable=resumable))
            raise
        except ServiceFailed:
            # The trainer or the coordinator died, which ends `meshrl up`; the run lives on in its store.
            say(resume_line(run_id, _status_if_answered(client, run_id), resumable=bool(cfg.run.redis_url)))
            raise
        return client.get_run(run_id)


def _status_if_answered(client, run_id: str):
    import grpc

    try:
        return client.get_run(run_id)
    except grpc.RpcError:             # the coordinator is the one that died
        return None


def _start_or_resume(client, data: dict, resume: str) -> tuple[str, int]:
    """A new run of `data`, or the run `resume` names continued (the coordinator reopened it from the store at
    its start, restoring its checkpoint into the new trainer); -> (run id, the first step to print)."""
    if not resume:
        run_id = client.start_run(yaml.safe_dump(data, sort_keys=False))
        say(f"run {run_id} started")
        _print_resolved(Path(client.get_run(run_id).run_dir) / "recipe.yaml")
        return run_id, 0
    status = client.get_run(resume)
    if status.finished:
        raise ValueError(f"--resume: run {resume!r} is {status.state}; there is nothing to resume")
    if status.state == "PAUSED":
        status = client.resume_run(resume)
    say(f"run {resume} resumed at step {status.step}/{status.num_steps}"
        + (f" ({status.message})" if status.message else ""))
    return resume, status.step + 1


def _print_resolved(recipe: Path) -> None:
    """The `auto` settings as the services resolved them (the comment atop the run's recipe.yaml), once."""
    try:
        lines = [line[4:] for line in recipe.read_text().splitlines() if line.startswith("#   ")]
    except OSError:
        return
    for line in lines:
        say(f"resolved: {line}")


def _placement(cfg, raw: dict, overrides: dict[str, str]) -> tuple[dict[str, list[str]], str]:
    """The GPUs of each replica by role, and the trainer's (all its ranks'); ValueError names a bad `devices:`."""
    from coordinator.cli.launcher import replica_devices

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


def _run_data(raw: dict, overrides: dict[str, str], addresses: dict[str, list[str]]) -> dict:
    """The run's config: the recipe without the trainer's and the replicas' addresses, which the coordinator
    holds as its default pools (coordinator.yaml) and fills in, so that a run resumed on a mesh started again
    (`--resume`, other ports) reaches that mesh. Env replicas, called by the rollout replicas, keep theirs."""
    data = _with_addresses(raw, overrides, addresses)
    for role in ("rollout", "reward", "reference"):
        if addresses.get(role):
            for key in ("servers", "dns", "registry"):
                data[role].pop(key, None)
    data.get("trainer", {}).pop("address", None)
    return data


def _with_addresses(raw: dict, overrides: dict[str, str], addresses: dict[str, list[str]]) -> dict:
    from services.common.config import deep_merge, nest_overrides

    data = deep_merge(raw, nest_overrides(overrides))
    for role in ("rollout", "reward", "reference", "env"):
        if addresses.get(role):
            data.setdefault(role, {})
            data[role]["servers"] = addresses[role]
            # A replica that dies is restarted (coordinator/cli/supervisor.py): calls wait for it rather than fail
            # the step when it was the role's only one.
            data[role].setdefault("rejoin_wait_s", REJOIN_WAIT_S)
    if addresses.get("trainer"):
        data.setdefault("trainer", {})["address"] = addresses["trainer"][0]
    return data


def env_replicas(cfg, raw: dict, overrides: dict[str, str]) -> int:
    """How many env replicas `meshrl up` starts: `env.replicas` when the recipe (or a flag) has an `env:` section,
    one when only the agent loop calls tools or an environment (it needs a replica that hosts them), else none. A
    section that names running replicas (`env.servers` / `env.dns`) and asks for no count keeps to those."""
    from services.common.rpc.pools import configured
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


def _follow(client, run_id: str, num_steps: int, *, warn_steps: int, from_step: int = 0) -> None:
    """One line per step above a live progress bar (reward, KL, throughput); the zero-reward-variance warning
    once, after `warn_steps` such steps in a row (run.zero_variance_warn_steps, coordinator/recipe/no_signal.py)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from coordinator.recipe.no_signal import NoSignalWatch, ShortBatchWatch

    no_signal, short = NoSignalWatch(warn_steps), ShortBatchWatch()

    with Progress(TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[stats]}"), console=console, transient=True) as progress:
        task = progress.add_task("run", total=num_steps, stats="")
        for m in client.stream_metrics(run_id, from_step):
            if "reward_mean" in m:
                say(step_line(m, num_steps), progress.console)
                stats = (f"margin {_fmt(m.get('reward_mean'))} {_fmt(m.get('pairs_per_s'), '.1f')} pairs/s"
                         if "dpo/loss" in m else
                         f"reward {_fmt(m.get('reward_mean'))} kl {_fmt(m.get('kl'), '.4f')} "
                         f"{_fmt(m.get('samples_per_s'), '.1f')} samples/s")
                progress.update(task, completed=int(m["step"]), stats=stats)
            for said in (no_signal.update(m), short.update(m)):
                if said:
                    say(said, progress.console, style="yellow")
            if "heldout_accuracy" in m:   # a mid-run evaluation arrives in its step's record
                label = "after" if m.get("final") else ("before" if m["step"] == 0 else f"at step {m['step']}")
                line = f"held-out accuracy {label}: {m['heldout_accuracy']:.1%}"
                if "heldout_preference_accuracy" in m:
                    line += (f"  preference accuracy {m['heldout_preference_accuracy']:.1%}  "
                             f"margin {_fmt(m.get('heldout_reward_margin'))}")
                say(line, progress.console)


def _follow_while_alive(launcher, client, run_id: str, num_steps: int, warn_steps: int,
                        from_step: int = 0) -> None:
    """Follows the run while coordinator/cli/supervisor.py restarts replicas that die; the loss of the coordinator,
    the trainer or every replica of a role ends `meshrl up` with the dead process's cause line, not a hang."""
    import threading

    from coordinator.cli.supervisor import Supervisor

    supervisor = Supervisor(launcher, say=say)
    done = threading.Event()
    errors: list[BaseException] = []

    def follow():
        try:
            _follow(client, run_id, num_steps, warn_steps=warn_steps, from_step=from_step)
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

    from coordinator.cli.report import plot_run

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
                      _pct(summary.get("heldout_accuracy_before")), _pct(summary.get("heldout_accuracy_after")),
                      ", ".join(f"{k} {v:.0%}" for k, v in shares))
        console.print(table)
        if summary.get("algorithm") == "dpo":
            say(f"held-out preference accuracy {_fmt(summary.get('heldout_preference_accuracy_before'), '.1%')}"
                f" -> {_fmt(summary.get('heldout_preference_accuracy_after'), '.1%')}")
    say(f"report: {image}")


def _pct(x) -> str:
    """A held-out accuracy, or "-" for a run with no held-out set (NaN)."""
    return "-" if x is None or math.isnan(x) else f"{x:.1%}"


def _print_result(status) -> None:
    before = status.last_metrics.get("heldout_accuracy_before")
    after = status.last_metrics.get("heldout_accuracy_after")
    say(f"run {status.run_id} {status.state} after {status.step} steps; metrics in {status.run_dir}"
        + (f" ({status.message})" if status.message else ""))
    if before is not None and after is not None and not (math.isnan(before) or math.isnan(after)):
        say(f"held-out accuracy before {before:.1%} -> after {after:.1%} ({(after - before) * 100:+.1f} points)")


@command(context_settings=PASSTHROUGH)
@connects
def run(ctx: typer.Context, config: Path = typer.Argument(..., dir_okay=False),
        follow: bool = typer.Option(True, help="stream metrics until the run ends"), *, conn: Connection):
    """Start a run on a running coordinator (`meshrl mesh`'s, or --coordinator): on the services the recipe lists,
    else on the mesh's replicas. After the recipe: verl's overrides (`actor_rollout_ref.rollout.n=8`, docs/from_verl.md) and meshrl's `--section.key value`."""
    from coordinator.recipe import verl_keys
    from coordinator.recipe.preflight import check_run
    from coordinator.recipe.run_settings import user_keys
    from services.common.config import deep_merge, nest_overrides

    # The config is checked here before anything is sent, as far as its own keys go; model folders, data files
    # and keys it leaves to the running services are checked by StartRun, on the coordinator's machine.
    verl, overrides = _recipe_args(list(ctx.args))
    raw, cfg = _load_recipe(config, verl, overrides)
    check_run(cfg, files="none", keys=set(user_keys(cfg)), names=verl_keys.user_keys(verl, cfg))
    text = (yaml.safe_dump(deep_merge(raw, nest_overrides(overrides)), sort_keys=False) if verl or overrides
            else config.read_text())
    with conn.client() as client:
        run_id = client.start_run(text)
        say(run_id)
        if follow:
            num_steps = client.get_run(run_id).num_steps
            try:
                _follow(client, run_id, num_steps, warn_steps=cfg.run.zero_variance_warn_steps)
            except Exception as e:  # noqa: BLE001 - only a coordinator lost mid-run is re-worded
                lost = LostCoordinator.of(e, conn.address, run_id)
                if lost is None:
                    raise
                raise lost from None
            status = client.get_run(run_id)
            _print_result(status)
            if status.state != "COMPLETED":  # as `meshrl up`: a run that failed or was stopped is exit 1
                raise typer.Exit(1)
