"""`meshrl mesh`: every service of a recipe as a process on 127.0.0.1, kept up between runs (replicas supervised as
under `meshrl up`), its coordinator's address recorded where `meshrl run`, `meshrl status` and `Client()` find it
(coordinator/mesh_address.py). `--detach` starts it in the background; `--stop` stops the recorded one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import typer

from coordinator import mesh_address
from coordinator.cli.common import PASSTHROUGH, command, console

# How long `--detach` and `--stop` wait for the mesh to come up or go (a start loads a model in every service).
DETACH_WAIT_S = 300.0
STOP_WAIT_S = 60.0


@command(context_settings=PASSTHROUGH)
def mesh(ctx: typer.Context,
         config: Optional[Path] = typer.Argument(None, dir_okay=False,
                                                 help="recipe YAML: model, replicas, devices (default: the "
                                                      "services' defaults, the tiny arithmetic model)"),
         detach: bool = typer.Option(False, "--detach", help="start it in the background; return once it serves"),
         stop: bool = typer.Option(False, "--stop", help="stop the running mesh (the one the mesh file records)"),
         run_dir: Optional[Path] = typer.Option(None, help="where run directories and logs go (default: "
                                                           "run.run_dir)"),
         threads: int = typer.Option(1, help="OMP threads per service process")):
    """Start every service of a recipe and keep them up, without a run, until Ctrl-C or SIGTERM (or `meshrl mesh
    --stop`). Prints the coordinator's address and records it in ~/.cache/meshrl/mesh.json, where `meshrl run`,
    `meshrl status` and `Client()` find it. After the recipe: verl's overrides and meshrl's `--section.key value`."""
    if stop:
        return _stop()
    if detach:
        return _detach([a for a in sys.argv[1:] if a != "--detach"])
    _serve(ctx, config, run_dir, threads)


def _serve(ctx: typer.Context, config: Path | None, run_dir: Path | None, threads: int) -> None:
    from coordinator.cli.launcher import Launcher
    from coordinator.cli.runs import _load_recipe, _placement, _recipe_args, _start_mesh, _write_private
    from coordinator.cli.supervisor import Supervisor
    from coordinator.recipe.fits import check_recipe_fits, fitted_line
    from coordinator.recipe.preflight import check_run

    verl, overrides = _recipe_args(list(ctx.args))
    if run_dir is not None:
        overrides["run.run_dir"] = str(run_dir)
    raw, cfg = _load_recipe(config, verl, overrides)
    check_run(cfg, world_size=cfg.trainer.nproc_per_node)
    placement, trainer_devices = _placement(cfg, raw, overrides)
    if fitted := check_recipe_fits(cfg, placement, trainer_devices):
        overrides.update(fitted)     # every service reads it as a command-line setting
        _say(fitted_line(fitted))
    log_dir = Path(cfg.run.run_dir).resolve() / "logs" / f"mesh-{time.strftime('%Y%m%d-%H%M%S')}"
    if verl or config is None:  # every service reads the recipe as given (with the verl keys' values in it)
        config = _write_private(log_dir / "recipe.yaml", raw)
    stopping = threading.Event()
    with Launcher(str(config), log_dir=log_dir, overrides=overrides, num_threads=threads) as launcher:
        addresses = _start_mesh(launcher, cfg, raw, overrides, placement, trainer_devices, training_api=True)
        coordinator = addresses["coordinator"][0]
        signal.signal(signal.SIGTERM, lambda *_: stopping.set())   # Launcher puts the old handler back
        path = mesh_address.write(coordinator, pid=os.getpid(), log_dir=str(log_dir), recipe=str(config),
                                  training=addresses["training"][0])
        try:
            _say(f"mesh up: {json.dumps(addresses)} (logs in {log_dir})")
            _say(f"meshrl mesh: coordinator at {coordinator}, recorded in {path}; `meshrl run RECIPE` starts a run "
                f"on it, Ctrl-C or `meshrl mesh --stop` stops it")
            _say(_training_line(addresses["training"][0]))
            supervisor = Supervisor(launcher, say=_say)
            try:
                while not stopping.wait(0.5):
                    supervisor.check()
            except KeyboardInterrupt:
                pass
            _say("meshrl mesh: stopping every service")
        finally:
            mesh_address.remove(os.getpid())


def _say(line: str) -> None:
    console.print(line, highlight=False, soft_wrap=True)


def _training_line(address: str) -> str:
    return (f"meshrl mesh: training API at {address} (docs/training_api.md: "
            f"services.training_api.client.ServiceClient() finds it)")


def _detach(args: list[str]) -> None:
    """Runs `meshrl mesh ARGS` as a background process of its own session (its output in a log file), and returns
    once it has recorded its address, or fails with its last line when it ends first."""
    log = Path(mesh_address.mesh_file().parent / "mesh-detached.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", *args], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + DETACH_WAIT_S
    while time.monotonic() < deadline:
        try:
            proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            found = mesh_address.read(note=lambda line: None)
            if found is not None and found["pid"] == proc.pid:
                _say(f"meshrl mesh: coordinator at {found['coordinator']} (pid {proc.pid}, logs in "
                     f"{found['log_dir']}, output in {log}); `meshrl mesh --stop` stops it")
                if found.get("training"):     # as the foreground mesh says it (docs/training_api.md)
                    _say(_training_line(found["training"]))
                return
            continue
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        raise RuntimeError(f"the mesh exited with code {proc.returncode} before serving: "
                           f"{lines[-1] if lines else 'no output'} (output: {log})")
    proc.terminate()
    raise RuntimeError(f"the mesh did not come up within {DETACH_WAIT_S:g}s (output: {log})")


def _stop() -> None:
    """SIGTERM to the recorded mesh, then wait until it has stopped its services and removed its record."""
    found = mesh_address.read()
    if found is None:
        raise ValueError(f"--stop: no running mesh is recorded in {mesh_address.mesh_file()}")
    pid = int(found["pid"])
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_WAIT_S
    while time.monotonic() < deadline and mesh_address.alive(pid):
        time.sleep(0.2)
    if mesh_address.alive(pid):
        raise RuntimeError(f"the mesh (pid {pid}) is still running {STOP_WAIT_S:g}s after SIGTERM; its logs: "
                           f"{found['log_dir']}")
    console.print(f"meshrl mesh: stopped the mesh at {found['coordinator']} (pid {pid})", highlight=False)
