"""The CPU demo as evidence: `meshrl up examples/arith/grpo.yaml` once, its result in bench/results/demo_cpu.json.

    OMP_NUM_THREADS=1 nice .venv/bin/python bench/demo_cpu.py [--shared]   # ~2-3 minutes on 2 cores

Runs the same command as `make demo` (every service its own process), then reads the run's summary.json and
metrics.jsonl: held-out greedy accuracy before and after, steps, the run's seconds (training, after start-up)
and the whole command's, the step time, and the rollout-vs-trainer log-prob parity (|dlogp| at the steps it
is measured). README.md's demo line is filled from this file (`make bench-docs`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.provenance import stamp  # noqa: E402

RECIPE = "examples/arith/grpo.yaml"
PARITY_KEY = "rollout_vs_trainer/logprob_abs_diff"


def summarize(run_dir: Path) -> dict:
    """The figures README.md quotes, from one finished run directory."""
    summary = json.loads((run_dir / "summary.json").read_text())
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [m for m in history if "reward_mean" in m]
    parity = [m[PARITY_KEY] for m in steps if PARITY_KEY in m]
    step_s = [m["time/step"] for m in steps if "time/step" in m]
    return {
        "steps": summary["steps"],
        "heldout_accuracy_before": summary["heldout_accuracy_before"],
        "heldout_accuracy_after": summary["heldout_accuracy_after"],
        "heldout_accuracy_by_step": {str(int(m["step"])): m["heldout_accuracy"] for m in history
                                     if "heldout_accuracy" in m},
        "run_seconds": summary["seconds"],
        "step_seconds_median": statistics.median(step_s) if step_s else None,
        "reward_mean_first_10": statistics.fmean(summary["reward_curve"][:10]),
        "reward_mean_last_10": statistics.fmean(summary["reward_curve"][-10:]),
        "logprob_parity": {"steps": [int(m["step"]) for m in steps if PARITY_KEY in m], "abs_diff": parity,
                           "max_abs_diff": max(parity) if parity else None},
        "phase_time_shares": summary.get("phase_time_shares"),
    }


def run_demo(work: Path, threads: int, overrides: list[str] = ()) -> tuple[Path, float]:
    """`meshrl up RECIPE` (with `--section.key value` overrides); the run directory and the command's seconds."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "coordinator.cli", "up", RECIPE, "--run-dir", str(work),
                    "--threads", str(threads), *overrides], cwd=REPO, env=env, check=True)
    wall = time.monotonic() - t0
    runs = sorted(p for p in work.iterdir() if (p / "summary.json").exists())
    if not runs:
        raise SystemExit(f"demo_cpu: no summary.json under {work}")
    return runs[-1], wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/demo_cpu.json")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--shared", action="store_true", help="record that other jobs shared the machine")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="meshrl-demo-") as tmp:
        run_dir, wall = run_demo(Path(tmp), args.threads)
        result = {"benchmark": "demo_cpu", "command": f"meshrl up {RECIPE}", "recipe": RECIPE,
                  "threads_per_service": args.threads, "cpus": os.cpu_count(),
                  "load_average_at_end": list(os.getloadavg()), "command_seconds": wall, **summarize(run_dir)}
    stamp("demo_cpu", result, shared_machine=args.shared)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"demo_cpu: {result['heldout_accuracy_before']:.1%} -> {result['heldout_accuracy_after']:.1%} in "
          f"{result['steps']} steps, {result['run_seconds']:.1f} s of run ({wall:.0f} s in all); wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
