"""The compose `run` service: starts the mounted recipe on the coordinator once and follows it to its end.

The run gets a fixed id (`--run-id`), so this driver and the coordinator can each restart without a second run
starting: a restarted coordinator resumes the run from its last committed step (run state lives in Redis) and
the driver finds it by that id and follows on. At the end it writes report.png beside summary.json in the
run's directory (the shared `runs` volume) and exits 0 only if the run completed.

    python deploy/compose_run.py /etc/meshrl/run.yaml --coordinator coordinator:50051 --run-id arith-grpo
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import grpc

from coordinator.cli.report import plot_run
from coordinator.client import Client, RunStatus

# A coordinator that restarts is UNAVAILABLE for a while (or drops the metric stream): wait and follow on.
TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
             grpc.StatusCode.UNKNOWN)


def say(line: str) -> None:
    print(f"compose-run: {line}", flush=True)


def get_or_start(client: Client, run_id: str, recipe: str) -> RunStatus:
    """The run with this id, started from the recipe if the coordinator does not know it yet."""
    try:
        return client.get_run(run_id)
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.NOT_FOUND:
            raise
    client.start_run(recipe, run_id=run_id)
    say(f"started run {run_id}")
    return client.get_run(run_id)


def follow(client: Client, run_id: str, recipe: str, wait_s: float) -> RunStatus:
    """Follows the run to its end across coordinator restarts (each gap at most `wait_s` seconds)."""
    last_ok, next_step = time.monotonic(), 0
    while True:
        try:
            status = get_or_start(client, run_id, recipe)
            last_ok = time.monotonic()
            if status.finished:
                return status
            for m in client.stream_metrics(run_id, from_step=next_step):
                last_ok = time.monotonic()
                if "reward_mean" in m:
                    next_step = int(m["step"]) + 1
                    say(f"step {int(m['step'])}/{status.num_steps} reward {m['reward_mean']:.3f} "
                        f"samples {int(m.get('num_samples', 0))}")
                elif "heldout_accuracy" in m:
                    say(f"held-out accuracy at step {int(m['step'])}: {m['heldout_accuracy']:.1%}")
            status = client.get_run(run_id)
            if status.finished:
                return status
        except grpc.RpcError as e:
            if e.code() not in TRANSIENT or time.monotonic() - last_ok > wait_s:
                raise
            say(f"coordinator {e.code().name}; following run {run_id} again in 2 s")
        time.sleep(2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path, help="the run recipe (YAML)")
    parser.add_argument("--coordinator", default="coordinator:50051", help="coordinator host:port")
    parser.add_argument("--run-id", default="compose", help="the run's id: an existing run is followed, not restarted")
    parser.add_argument("--wait-s", type=float, default=600.0,
                        help="how long the coordinator may stay unreachable before this gives up")
    args = parser.parse_args(argv)
    with Client(args.coordinator, timeout=60) as client:
        status = follow(client, args.run_id, args.config.read_text(), args.wait_s)
    say(f"run {status.run_id} {status.state} after {status.step} steps; metrics in {status.run_dir}"
        + (f" ({status.message})" if status.message else ""))
    before = status.last_metrics.get("heldout_accuracy_before")
    after = status.last_metrics.get("heldout_accuracy_after")
    if before is not None and after is not None:
        say(f"held-out accuracy before {before:.1%} -> after {after:.1%} ({(after - before) * 100:+.1f} points)")
    run_dir = Path(status.run_dir)
    if (run_dir / "metrics.jsonl").is_file():
        say(f"report: {plot_run(run_dir)}")
    return 0 if status.state == "COMPLETED" else 1


if __name__ == "__main__":
    sys.exit(main())
