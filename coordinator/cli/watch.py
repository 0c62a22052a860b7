"""`meshrl watch RUN_ID`: a live terminal view of a run (rich): step, reward and accuracy sparklines, the last
step's phase times, the replicas with their weight versions, and the last warning. `meshrl watch` with no run id:
every run on the mesh, one row each (docs/many_runs.md). `--once` prints either once."""

from __future__ import annotations

import math
import threading
import time

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from coordinator.cli.common import columns, version

BLOCKS = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 40


def sparkline(values: list[float], width: int = SPARK_WIDTH) -> str:
    """The last `width` finite values as block characters, scaled between their min and max."""
    vals = [v for v in values if math.isfinite(v)][-width:]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    span = hi - lo or 1.0
    return "".join(BLOCKS[min(len(BLOCKS) - 1, int((v - lo) / span * len(BLOCKS)))] for v in vals)


def warnings(status, replicas) -> list[str]:
    """What an operator should look at, worst last: unhealthy or lagging replicas, then the run's own message."""
    out = []
    for r in replicas:
        if not r.healthy:
            out.append(f"{r.pool} replica {r.address} is unhealthy")
        elif r.pool == "rollout" and 0 <= r.weight_version < status.weight_version:
            out.append(f"rollout replica {r.address} serves weight version {r.weight_version} < "
                       f"{status.weight_version}")
    if status.message:
        out.append(f"{status.state.lower()}: {status.message}")
    return out


def view(status, history: list[dict], replicas) -> Group:
    """One frame: the run's header, its curves, phase times, replicas and the last warning."""
    steps = [m for m in history if "reward_mean" in m]
    last = steps[-1] if steps else {}
    pending = f" ({status.pending_command} pending)" if status.pending_command else ""
    head = Text.assemble((f"{status.run_id}  ", "bold"), f"{status.state}{pending}  step {status.step}/"
                         f"{status.num_steps}  weight version {status.weight_version}")
    curves = Table(box=None, show_header=False, pad_edge=False)
    for key, label in (("reward_mean", "reward"), ("accuracy", "accuracy")):
        series = [m.get(key, math.nan) for m in steps]
        now = series[-1] if series else math.nan
        curves.add_row(label, f"{now:.3f}" if math.isfinite(now) else "-", sparkline(series))
    held = [m["heldout_accuracy"] for m in history if "heldout_accuracy" in m]
    if held:
        curves.add_row("held-out", f"{held[-1]:.3f}", sparkline(held))
    phases = Table("phase", "seconds", "share", box=None, pad_edge=False)
    total = last.get("time/step", 0.0) or 1.0
    for key, value in sorted(last.items(), key=lambda kv: -kv[1] if kv[0].startswith("time/") else 0):
        if key.startswith("time/") and key != "time/step":
            phases.add_row(key[5:], f"{value:.3f}", "#" * max(1, round(20 * value / total)))
    if last:
        phases.add_row("step", f"{last.get('time/step', math.nan):.3f}", "")
    reps = Table("pool", "replica", "healthy", "weight version", "load", box=None, pad_edge=False)
    for r in replicas:
        reps.add_row(r.pool, r.address, "yes" if r.healthy else "NO", version(r.weight_version), str(r.load))
    warned = warnings(status, replicas)
    warning = Text(f"last warning: {warned[-1]}" if warned else "last warning: none",
                   style="yellow" if warned else "dim")
    return Group(head, curves, phases, reps, warning)


class _Metrics:
    """Follows the run's metric stream on a thread (StreamMetrics blocks until the run ends)."""

    def __init__(self, client, run_id: str):
        self.history: list[dict] = []
        self.ended = threading.Event()
        self.error: Exception | None = None
        self._new = threading.Condition()
        threading.Thread(target=self._follow, args=(client, run_id), daemon=True).start()

    def _follow(self, client, run_id: str) -> None:
        try:
            for m in client.stream_metrics(run_id):
                with self._new:
                    self.history.append(m)
                    self._new.notify_all()
        except Exception as e:  # noqa: BLE001 - the channel closing at exit ends the stream too
            self.error = e
        finally:
            with self._new:
                self.ended.set()
                self._new.notify_all()

    def wait_for_step(self, step: int, timeout: float) -> None:
        """Until the stream delivered `step` (or ended)."""
        with self._new:
            self._new.wait_for(lambda: self.ended.is_set() or any(m["step"] >= step for m in self.history),
                               timeout)

    def wait_for_end(self, timeout: float) -> None:
        """Until the stream ended: an ended run's last record (`final: 1`, the held-out accuracy after training)
        comes after its last step's, at the same step number."""
        self.ended.wait(timeout)


def watch_run(client, run_id: str, *, once: bool = False, refresh_s: float = 1.0,
              console: Console | None = None) -> None:
    """Draws the view until the run ends (or once); the last frame stays on screen."""
    console = console or Console()
    metrics = _Metrics(client, run_id)

    def frame():
        status = client.get_run(run_id)
        if status.finished:     # its whole stream: the frame shows the held-out accuracy after training too
            metrics.wait_for_end(timeout=10.0)
        else:
            metrics.wait_for_step(status.step, timeout=10.0 if once else 0.0)
        return status, view(status, list(metrics.history), client.list_services(run_id))

    if once:
        console.print(frame()[1])
        return
    status, renderable = frame()
    with Live(renderable, console=console, refresh_per_second=4) as live:
        while not status.finished:
            time.sleep(refresh_s)
            status, renderable = frame()
            live.update(renderable)
    if not console.is_terminal:     # Live leaves its last frame without a line end when stdout is not a terminal
        console.line()
    console.print(f"{run_id}: {status.state} at step {status.step}/{status.num_steps}")


MESH_SPARK_WIDTH = 20
# Active runs first, then the finished ones (dimmed), each group in the coordinator's order.
_ORDER = {"RUNNING": 0, "PAUSED": 1}


def _num(value) -> str:
    return f"{value:.3f}" if value is not None and math.isfinite(value) else "-"


def mesh_view(runs, curves: dict[str, list[float]]) -> Group:
    """One frame of every run: a count by state, then a line per run, active first (finished ones dimmed).
    `curves`: each run's reward at the steps seen while watching (its sparkline). The lines are plain aligned
    columns, as `meshrl status` prints them: a long run id is never cut by a table squeezing to the terminal."""
    runs = sorted(runs, key=lambda r: _ORDER.get(r.state, 2))
    counts = {state: sum(r.state == state for r in runs) for state in ("RUNNING", "PAUSED")}
    finished = sum(r.finished for r in runs)
    head = Text.assemble((f"{len(runs)} runs on the mesh", "bold"),
                         f"  {counts['RUNNING']} running, {counts['PAUSED']} paused, {finished} finished")
    # adapter "-": the trainer's run adapter (the first LoRA run on a trainer) or a full-parameter run.
    rows = [(r.run_id, r.adapter or "-", r.state, f"{r.step}/{r.num_steps}", str(r.weight_version),
             _num(r.last_metrics.get("reward_mean")), _num(r.last_metrics.get("accuracy")),
             sparkline(curves.get(r.run_id, []), MESH_SPARK_WIDTH), r.message) for r in runs]
    header, *lines = columns(("run", "adapter", "state", "step", "weights", "reward", "accuracy", "reward curve",
                              "message"), rows)
    table = Text(header, style="bold", no_wrap=True, overflow="ignore")
    for r, line in zip(runs, lines):
        table.append("\n")
        table.append(line, style="dim" if r.finished else None)
    return Group(head, table)


def watch_mesh(client, *, once: bool = False, refresh_s: float = 1.0, console: Console | None = None) -> bool:
    """Draws every run until all of them ended (or once); -> False when the coordinator knows no run."""
    console = console or Console()
    curves: dict[str, list[float]] = {}
    seen: dict[str, int] = {}

    def frame():
        runs = client.list_runs()
        for r in runs:           # one point per step seen: a refresh inside one step adds nothing
            reward = r.last_metrics.get("reward_mean")
            if reward is not None and seen.get(r.run_id) != r.step:
                seen[r.run_id] = r.step
                curves.setdefault(r.run_id, []).append(reward)
        return runs, mesh_view(runs, curves)

    runs, renderable = frame()
    if not runs:
        return False
    if once:
        console.print(renderable, crop=False)    # whole lines, for grep and for copying a run id
        return True
    with Live(renderable, console=console, refresh_per_second=4) as live:
        while not all(r.finished for r in runs):
            time.sleep(refresh_s)
            runs, renderable = frame()
            live.update(renderable)
    if not console.is_terminal:
        console.line()
    console.print(f"all {len(runs)} runs ended: " + ", ".join(f"{r.run_id} {r.state}" for r in runs), soft_wrap=True)
    return True
