"""Two LoRA runs at once on one mesh, each with its own learning rate, from a plain gRPC client.

The trainer holds one frozen base; the first run trains its run adapter, the second a named adapter of its own beside
it (docs/many_runs.md); the rollout, reward and reference pools are shared, granted by `run.priority`. Both runs'
metrics are followed at once; each line printed is one run's summary: its state, steps, learning rate and held-out
accuracy. `--stop-first-after K` stops the first run after its K-th step, to show the second one's steps go on.

    meshrl mesh examples/arith/grpo_lora.yaml --detach     # a mesh that stays up (docs/coordinator.md)
    python examples/run_api/concurrent_runs.py --config examples/arith/grpo_lora.yaml --steps 10

Nothing from meshrl is imported: the coordinator's methods are found by gRPC reflection (as in two_runs.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import grpc
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from two_runs import Coordinator, merged, mesh_coordinator  # noqa: E402  (the reflection client beside this script)

RUNS = ({"run": {"name": "lora-fast", "priority": 1.0}, "actor": {"lr": 1e-3}},
        {"run": {"name": "lora-slow", "priority": 1.0}, "actor": {"lr": 3e-4}})


def follow(coordinator: Coordinator, run_id: str, out: dict, stop_after: int = 0) -> None:
    """Streams one run's metrics to its end into `out` (each step's lr and the wall time it arrived)."""
    steps = out.setdefault("steps", [])
    for m in coordinator.call("StreamMetrics", coordinator.message("StreamMetrics", run_id=run_id)):
        if "reward_mean" in m.metrics:
            steps.append({"step": m.step, "lr": m.metrics.get("actor/lr"), "at": time.time()})
            if stop_after and len(steps) == stop_after:
                coordinator.call("StopRun", coordinator.message("StopRun", run_id=run_id))
                out["stopped_at"] = time.time()
    status = coordinator.call("GetRun", coordinator.message("GetRun", run_id=run_id))
    out["state"] = status.DESCRIPTOR.fields_by_name["state"].enum_type.values_by_number[status.state].name
    out["message"] = status.message
    out["adapter"] = status.adapter          # "" = the trainer's run adapter; else this run's named one
    out["heldout_accuracy"] = [status.last_metrics.get("heldout_accuracy_before"),
                               status.last_metrics.get("heldout_accuracy_after")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--coordinator", default="", help="HOST:PORT (default: the running mesh's, as meshrl finds it)")
    parser.add_argument("--config", required=True, help="the mesh's LoRA recipe (YAML)")
    parser.add_argument("--steps", type=int, default=0, help="run.num_steps of both runs (0: the recipe's)")
    parser.add_argument("--stop-first-after", type=int, default=0, help="stop the first run after this many steps")
    args = parser.parse_args(argv)
    base = yaml.safe_load(Path(args.config).read_text())
    with grpc.insecure_channel(args.coordinator or mesh_coordinator()) as channel:
        coordinator = Coordinator(channel)
        results, threads = [], []
        for i, changes in enumerate(RUNS):
            config = merged(base, changes)
            if args.steps:
                config["run"]["num_steps"] = args.steps
            try:
                run_id = coordinator.call("StartRun", coordinator.message("StartRun",
                                                                          config=json.dumps(config))).run_id
            except grpc.RpcError as e:
                print(json.dumps({"asked": changes, "refused": f"{e.code().name}: {e.details()}"}))
                return 1
            out = {"run_id": run_id, "asked_lr": changes["actor"]["lr"]}
            results.append(out)
            stop = args.stop_first_after if i == 0 else 0
            threads.append(threading.Thread(target=follow, args=(coordinator, run_id, out, stop)))
            threads[-1].start()
        for t in threads:
            t.join()
    for out in results:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
