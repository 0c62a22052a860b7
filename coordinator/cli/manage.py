"""The commands that look at or steer runs once they started (status, watch, trace, stop, pause, resume,
services), and the offline ones (plot, profile-model, memory)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from coordinator.cli.common import PASSTHROUGH, Connection, _fmt, columns, command, connects, console, say, version


@command()
@connects
def status(run_id: Optional[str] = typer.Argument(None), *, conn: Connection):
    """Show one run, or every run the coordinator knows."""
    with conn.client() as client:
        runs = [client.get_run(run_id)] if run_id else client.list_runs()
    if not runs:
        say(f"no runs on the coordinator at {conn.address}; `meshrl run RECIPE` starts one")
        return
    # adapter: the run's named adapter when it trains beside other LoRA runs on one trainer (docs/many_runs.md).
    rows = [(r.run_id, r.state, f"{r.step}/{r.num_steps}", str(r.weight_version), str(r.data_position),
             _fmt(r.last_metrics.get("reward_mean")), r.adapter or "-", status_message(r)) for r in runs]
    for line in columns(("run", "state", "step", "weight version", "data position", "reward", "adapter", "message"),
                        rows):
        say(line)


@command()
@connects
def watch(run_id: Optional[str] = typer.Argument(None, help="the run to watch; none: every run on the mesh"),
          once: bool = typer.Option(False, "--once", help="print the view once and exit"), *, conn: Connection):
    """Live view of a run: step, reward and accuracy sparklines, phase times, replicas and versions, last warning.
    With no run id, every run on the mesh: one row each (run, adapter, state, step, reward, accuracy)."""
    from coordinator.cli.watch import watch_mesh, watch_run

    with conn.client() as client:
        if run_id:
            watch_run(client, run_id, once=once, console=console)
        elif not watch_mesh(client, once=once, console=console):
            say(f"no runs on the coordinator at {conn.address}; `meshrl run RECIPE` starts one")


@command()
def trace(run: str = typer.Argument(..., help="run id (under --runs-dir) or run directory"),
          step: int = typer.Argument(..., help="the step whose trace to print"),
          runs_dir: Path = typer.Option(Path("runs"), "--runs-dir", help="where run directories are (run.run_dir)")):
    """A step's trace (runs/<id>/traces.jsonl) as a tree with durations, its critical path marked."""
    from coordinator.cli.traces import print_step
    print_step(run, step, runs_dir, console)


@command()
@connects
def stop(run_id: str, *, conn: Connection):
    """Stop a run after its current step."""
    with conn.client() as client:
        say(command_line(client.stop_run(run_id), "stop"))


def status_message(status) -> str:
    """`meshrl status`'s message cell: a pause or stop still pending (it lands after the step in flight), then the
    run's own message. The state cell stays the API's state, one word for `awk`."""
    pending = {"stop": "stops after its current step", "pause": "pauses after its current step"}
    return "; ".join(m for m in (pending.get(status.pending_command, ""), status.message) if m)


def command_line(status, asked: str) -> str:
    """What `meshrl pause` / `meshrl resume` / `meshrl stop` print: the run's state now, or the step it pauses or
    stops after."""
    at = f"{status.step}/{status.num_steps}"
    if asked == "pause" and status.state == "RUNNING":
        return f"run {status.run_id} pauses after its current step (steps done: {at}); `meshrl resume` continues it"
    if asked == "stop" and status.pending_command == "stop":
        return f"run {status.run_id} stops after its current step (steps done: {at})"
    return f"run {status.run_id} {status.state} at step {at}" + (f" ({status.message})" if status.message else "")


@command()
@connects
def pause(run_id: str, *, conn: Connection):
    """Pause a run after its current step; `meshrl resume RUN_ID` continues it."""
    with conn.client() as client:
        say(command_line(client.pause_run(run_id), "pause"))


@command()
@connects
def resume(run_id: str, *, conn: Connection):
    """Resume a paused run (one paused for a lost trainer reconnects, restoring its last checkpoint)."""
    with conn.client() as client:
        say(command_line(client.resume_run(run_id), "resume"))


@command()
@connects
def services(run_id: Optional[str] = typer.Argument(None, help="a run's pools (default: the coordinator's own)"), *,
             conn: Connection):
    """Replicas of every pool with health, weight version and load."""
    with conn.client() as client:
        replicas = client.list_services(run_id or "")
    rows = [(r.pool, r.address, "yes" if r.healthy else "no", version(r.weight_version), str(r.load))
            for r in replicas]
    for line in columns(("pool", "address", "healthy", "weight version", "load"), rows):
        say(line)


@command()
def plot(run_dir: Path = typer.Argument(..., help="a run directory (runs/<run id>)"),
         out: Optional[Path] = typer.Option(None, "--out", "-o", help="PNG path (default RUN_DIR/report.png)")):
    """PNG curves of reward, accuracy, KL, entropy, response length, sparse metrics as points, and the step-time
    breakdown; a panel whose metrics the run never logged is left out."""
    from coordinator.cli.report import plot_run

    if not run_dir.is_dir():
        raise ValueError(f"{run_dir}: " + ("not a directory" if run_dir.exists() else "no such run directory"))
    say(str(plot_run(run_dir, out)))


@command("profile-model")
def profile_model_cmd(model_path: str = typer.Argument(..., help="local Hugging Face model folder"),
                      seq_len: int = typer.Option(2048, help="sequence length for attention FLOPs"),
                      pp_size: int = typer.Option(1, help="pipeline stages to balance"),
                      as_json: bool = typer.Option(False, "--json", help="print JSON")):
    """Per-layer parameters and FLOPs, and a balanced pipeline stage split."""
    from rich.table import Table

    from services.common.tensors.profile_model import profile_model

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


@command(context_settings=PASSTHROUGH)
def memory(ctx: typer.Context, config: Path = typer.Argument(..., dir_okay=False, help="recipe YAML"),
           gpu_gib: Optional[float] = typer.Option(None, "--gpu-gib",
                                                   help="memory of each GPU (default: the GPUs found, if any)")):
    """Estimated GPU memory of each service of a recipe (coordinator/recipe/memory.py), summed per GPU as `meshrl up`
    places them, and whether it fits. After the recipe: `--section.key value` flags, as `meshrl up` takes."""
    from rich.table import Table

    from coordinator.recipe import fits, memory as mem
    from coordinator.cli.runs import _load_recipe, _placement, _recipe_args

    verl, overrides = _recipe_args(list(ctx.args))
    raw, cfg = _load_recipe(config, verl, overrides)
    placement, trainer_devices = _placement(cfg, raw, overrides)
    gpu_bytes = int(gpu_gib * mem.GIB) if gpu_gib else fits.gpu_memory()
    estimates = mem.estimate(cfg, placement, trainer_devices, mem.memory_of(gpu_bytes, "cuda:0"))
    if not estimates:
        console.print(f"no service of {config} runs on a GPU (model.device: {cfg.model.device})", highlight=False)
        return
    table = Table("service", "GPU", "GiB", "parts (GiB)")
    for e in estimates:
        table.add_row(e.service, e.gpu, mem.gib(e.total),
                      ", ".join(f"{name} {mem.gib(n)}" for name, n in e.parts.items()))
    console.print(table)
    for gpu, group in mem.by_gpu(estimates).items():
        total, size = sum(e.total for e in group), mem.memory_of(gpu_bytes, gpu)
        verdict = "" if size is None else (
            f" of {mem.gib(size)} GiB: " + ("fits" if total <= mem.FIT_FRACTION * size else
                                             f"does not fit ({mem.FIT_FRACTION:.0%} usable)"))
        console.print(f"{gpu}: about {mem.gib(total)} GiB{verdict}", highlight=False)
    if gpu_bytes and (fitted := fits.fit_auto_pool(cfg, placement, gpu_bytes, trainer_devices)[1]):
        console.print(f"meshrl up sets {fits.fitted_line(fitted)}", highlight=False, soft_wrap=True)
