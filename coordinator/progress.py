"""A live rich progress bar over a run's metric stream (reward, KL, throughput)."""

from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def watch_run(client, run_id: str) -> None:
    total = client.get_run(run_id).num_steps
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[stats]}")) as progress:
        task = progress.add_task(run_id, total=total, stats="")
        for m in client.stream_metrics(run_id):
            if "reward_mean" not in m:
                continue
            stats = (f"reward {m['reward_mean']:.3f}  kl {m.get('kl', float('nan')):.4f}  "
                     f"{m.get('samples_per_s', 0):.1f} samples/s")
            progress.update(task, completed=int(m["step"]), stats=stats)
    status = client.get_run(run_id)
    print(f"{run_id}: {status.state} at step {status.step}/{status.num_steps}")
