"""Async RL against synchronous meshrl, on the fixed and the long-tailed workload (bench/e2e_grpo.py runs).

`run`: for each round, workload (fixed: every sample max_new_tokens; longtail: lognormal lengths, median 96,
capped at 1,024 new tokens) and mode, one e2e_grpo.py run (its own mesh), interleaved, each written to
--out-dir/<workload>-<mode>-r<round>.json. Modes:
  sync       run.async_mode false (the baseline)
  k1         run.max_staleness 1, rollout correction bypass (PPO ratio against the rollout's log-probs)
  k2         run.max_staleness 2, partial rollouts (continue), rollout correction bypass
`combine`: those files -> one JSON: per workload and mode the step time (median over timed steps and rounds),
samples/s, phase medians, staleness; the speed-up of each async mode over sync; and, from the sync runs' own
phases, the overlap bound (generate + rest) / max(generate, rest) that one step can reach when generation hides
behind the rest, beside what async measured (on one GPU the two share the device: time-slicing).

    # CPU smoke (tiny random model, short)
    PYTHONPATH=.:protos python bench/async_rl.py run --shape tiny-256 --steps 5 --warmup-steps 1 --length-cap 128 \
        --out-dir /tmp/async-runs && PYTHONPATH=.:protos python bench/async_rl.py combine --out-dir /tmp/async-runs \
        --out /tmp/async_cpu_smoke.json
    # GPU (bench/gpu_session.sh asyncbench; asyncsplit on two GPUs: rollout on cuda:1, trainer on cuda:0)
    python3 bench/async_rl.py run --device cuda --shape qwen2.5-0.5b --workloads longtail --out-dir $OUT/async

`combine` also writes, per workload and async mode, the measured bound (`measured_bounds`): the growth of each
non-generate part of the step over sync's, the time-slicing share (scoring and train growth over sync's generate
time) and the step it implies; and each unmet goal's `bound` (time_slicing, tail, host_phases) with its reason.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.peers.settings import median  # noqa: E402
from bench.provenance import stamp  # noqa: E402

MODES = {"sync": [], "k1": ["--async-k", "1", "--correction", "bypass"],
         "k2": ["--async-k", "2", "--partial", "continue", "--correction", "bypass"]}
PHASES = ("generate", "reward", "reference", "old_logprobs", "train", "weight_sync")
CONCURRENT = ("reward", "reference", "old_logprobs")
PARTS = ("generate", "score", "train", "weight_sync", "host")


def cmd_run(args) -> None:
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for r in range(args.rounds):
        for workload in args.workloads.split(","):
            for mode in args.modes.split(","):
                out = args.out_dir / f"{workload}-{mode}-r{r}.json"
                cmd = [sys.executable, str(REPO / "bench/e2e_grpo.py"), "run", "--device", args.device,
                       "--shape", args.shape, "--seed", "1", "--lengths", workload,
                       "--length-cap", str(args.length_cap), "--threads", str(args.threads),
                       "--work-dir", str(args.work_dir), "--out", str(out), "--placement", args.placement,
                       *MODES[mode]]
                if args.weight_transport:
                    cmd += ["--weight-transport", args.weight_transport]
                if args.steps:
                    cmd += ["--steps", str(args.steps)]
                if args.warmup_steps is not None:
                    cmd += ["--warmup-steps", str(args.warmup_steps)]
                print(f"== {workload} {mode} round {r}", flush=True)
                subprocess.run(cmd, cwd=REPO, check=True)


def summary(runs: list[dict]) -> dict:
    """Medians over the runs of one (workload, mode), and the mean step split into the parts async changes."""
    steps = [row for r in runs for row in r["steps"] if row["step"] > r["settings"]["warmup_steps"]]
    parts = [step_parts(s) for s in steps if s.get("interval_seconds") is not None]
    return {"runs": len(runs), "seconds_per_step_median": median([r["seconds_per_step_median"] for r in runs]),
            "interval_seconds_median": median([r["interval_seconds_median"] for r in runs]),
            "samples_per_s": median([r["samples_per_s"] for r in runs]),
            "phase_seconds_median": {k: median([s["phases"][k] for s in steps]) for k in PHASES},
            # means, so the parts add up to the mean step interval
            "step_parts_mean_s": {k: sum(p[k] for p in parts) / max(len(parts), 1) for k in PARTS},
            "response_length_mean": median([s["response_length_mean"] for s in steps]),
            "response_length_max": median([s.get("response_length_max") or 0 for s in steps]),
            "staleness_max": max((s.get("staleness_max") or 0 for s in steps), default=0),
            "partial_samples_per_step": median([s.get("partial_samples") or 0 for s in steps]),
            "mode": runs[0]["mode"], "workload": runs[0]["workload"],
            "placement": runs[0].get("placement", "shared")}


def step_parts(row: dict) -> dict:
    """One step's interval as generate wait, scoring (reward, reference and old log-probs run at once: the
    longest), train, weight sync and the host time outside those phases."""
    ph = row["phases"]
    score = max(ph[k] for k in CONCURRENT)
    return {"generate": ph["generate"], "score": score, "train": ph["train"], "weight_sync": ph["weight_sync"],
            "host": row["interval_seconds"] - ph["generate"] - score - ph["train"] - ph["weight_sync"]}


def overlap_bound(sync: dict) -> dict:
    """From the sync run's phases: generation hidden behind the rest of the step, at best."""
    ph = sync["phase_seconds_median"]
    generate = ph["generate"]
    rest = sync["interval_seconds_median"] - generate
    return {"generate_s": generate, "rest_of_step_s": rest,
            "bound_speedup": sync["interval_seconds_median"] / max(generate, rest, 1e-9),
            "meaning": "step time of sync / max(generate, everything else): what async reaches when the "
                       "generation of later steps fully overlaps this step's scoring, training and sync"}


def measured_bound(sync: dict, mode: dict) -> dict:
    """What an async mode's step costs beyond sync's step without its generation, measured part by part.

    time_slicing: growth of the scoring and train phases (the rollout decodes on the same GPU meanwhile);
    tail: generation not hidden (the step still waits for it) plus the weight sync's growth (an update waiting
    for the generation in flight); host_phases: growth of the host time outside the phases."""
    s, a = sync["step_parts_mean_s"], mode["step_parts_mean_s"]
    generate = s["generate"]
    sync_step = sum(s.values())
    growth = {k: a[k] - s[k] for k in PARTS if k != "generate"}
    slicing = growth["score"] + growth["train"]
    implied = sync_step - generate + slicing
    return {"non_generate_growth_s": growth,
            "time_slicing": {"growth_s": slicing, "share_of_sync_generate": slicing / max(generate, 1e-9),
                             "implied_step_s": implied, "implied_speedup": sync_step / implied,
                             "meaning": "sync's step with its generation fully hidden, plus the growth of the "
                                        "scoring and train phases while the rollout shares the GPU"},
            "excess_s": {"time_slicing": slicing, "tail": a["generate"] + growth["weight_sync"],
                         "host_phases": growth["host"]},
            "sync_step_s": sync_step, "step_s": sum(a.values()), "speedup": sync_step / sum(a.values())}


def verdict(entry: dict, mode: str, speedup: float, target: float) -> dict:
    """A speed-up goal met or not, and if not, what bounds it: the sync phases themselves when even a fully hidden
    generation cannot reach the target (overlap bound), else the largest measured excess over that ideal."""
    out = {"met": speedup >= target, "best_mode": mode, "speedup": speedup}
    if out["met"]:
        return out
    ob = entry["overlap_bound_from_sync_phases"]
    if ob["bound_speedup"] < target:
        longer = "tail" if ob["generate_s"] >= ob["rest_of_step_s"] else "rest_of_step"
        return {**out, "bound": longer, "reason": f"even with generation fully hidden the step is at least "
                f"max(generate {ob['generate_s']:.3f} s, rest {ob['rest_of_step_s']:.3f} s): "
                f"{ob['bound_speedup']:.2f}x < {target}x"}
    mb = entry["measured_bounds"][mode]
    excess = mb["excess_s"]
    worst = max(excess, key=excess.get)
    detail = ", ".join(f"{k} {v:+.3f} s" for k, v in excess.items())
    reason = (f"step {mb['step_s']:.3f} s vs sync's {mb['sync_step_s']:.3f} s; beyond sync without its "
              f"generation: {detail}")
    if worst == "time_slicing":
        ts = mb["time_slicing"]
        reason += (f"; scoring and train grew by {ts['share_of_sync_generate']:.0%} of sync's generate time: "
                   f"implied step {ts['implied_step_s']:.3f} s ({ts['implied_speedup']:.2f}x)")
    return {**out, "bound": worst, "reason": reason}


def cmd_combine(args) -> None:
    files = sorted(args.out_dir.glob("*-r*.json"))
    by: dict[tuple[str, str], list[dict]] = {}
    for f in files:
        workload, mode, _ = f.stem.rsplit("-", 2)
        by.setdefault((workload, mode), []).append(json.loads(f.read_text()))
    if not by:
        raise SystemExit(f"combine: no runs under {args.out_dir}")
    first = next(iter(by.values()))[0]
    result = {"benchmark": "async RL vs synchronous meshrl: GRPO end to end through the mesh, fixed and long-tailed "
                           "response lengths", "device": first["device"], "shape": first["settings"]["shape"],
              "batch": f"{first['settings']['prompts_per_step']} prompts x {first['settings']['n']} samples",
              "modes": {m: " ".join(a) or "synchronous" for m, a in MODES.items()},
              "placement": first.get("placement", "shared"), "workloads": {}}
    for workload in sorted({w for w, _ in by}):
        modes = {m: summary(runs) for (w, m), runs in by.items() if w == workload}
        entry: dict = {"workload": first_of(by, workload)["workload"], "modes": modes}
        if "sync" in modes:
            base = modes["sync"]["interval_seconds_median"]
            entry["speedup_over_sync"] = {m: base / v["interval_seconds_median"] for m, v in modes.items()
                                          if m != "sync"}
            entry["overlap_bound_from_sync_phases"] = overlap_bound(modes["sync"])
            entry["measured_bounds"] = {m: measured_bound(modes["sync"], v) for m, v in modes.items() if m != "sync"}
        result["workloads"][workload] = entry
    goals = {}
    for workload, target in (("longtail", 1.3), ("fixed", 1.05)):
        sp = result["workloads"].get(workload, {}).get("speedup_over_sync")
        if sp:
            best = max(sp, key=sp.get)
            goals[f"{workload}_async_at_least_{target}x_sync"] = verdict(result["workloads"][workload], best,
                                                                         sp[best], target)
    for workload, path in (("fixed", args.trl_fixed), ("longtail", args.trl_longtail)):
        entry = result["workloads"].get(workload)
        if path and entry:       # TRL GRPOTrainer on the same workload (bench/peers/trl_grpo.py --lengths)
            trl = json.loads(Path(path).read_text())
            entry["trl"] = {k: trl[k] for k in ("seconds_per_step_median", "interval_seconds_median", "samples_per_s",
                                                 "phase_seconds_median", "workload") if k in trl}
            entry["over_trl"] = {m: trl["interval_seconds_median"] / v["interval_seconds_median"]
                                 for m, v in entry["modes"].items()}
            if workload == "longtail":
                best = max(entry["over_trl"], key=entry["over_trl"].get)
                goals["longtail_at_least_7x_trl"] = {"met": entry["over_trl"][best] >= 7, "best_mode": best,
                                                     "ratio": entry["over_trl"][best]}
    result["goals"] = goals
    if first["device"] == "cuda":
        stamp("async_gpu", result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1).replace(str(REPO) + "/", ""))
    for w, e in result["workloads"].items():
        print(w, {m: round(v["interval_seconds_median"], 3) for m, v in e["modes"].items()},
              {m: round(x, 2) for m, x in e.get("speedup_over_sync", {}).items()})
    print(f"wrote {args.out}")


def first_of(by: dict, workload: str) -> dict:
    return next(runs[0] for (w, _), runs in by.items() if w == workload)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    r.add_argument("--shape", default="tiny-256")
    r.add_argument("--workloads", default="fixed,longtail")
    r.add_argument("--modes", default="sync,k1,k2")
    r.add_argument("--rounds", type=int, default=1)
    r.add_argument("--steps", type=int)
    r.add_argument("--warmup-steps", type=int)
    r.add_argument("--length-cap", type=int, default=1024)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--placement", choices=["shared", "split"], default="shared",
                   help="split: rollout on cuda:1, trainer and reference on cuda:0 (bench/e2e_grpo.py)")
    r.add_argument("--weight-transport", choices=["ipc", "nccl", "grpc"], help="default: ipc shared, nccl split")
    r.add_argument("--work-dir", type=Path, default=Path("/tmp/meshrl-bench"))
    r.add_argument("--out-dir", type=Path, required=True)
    c = sub.add_parser("combine")
    c.add_argument("--out-dir", type=Path, required=True)
    c.add_argument("--trl-fixed", help="bench/peers/trl_grpo.py output on the fixed workload")
    c.add_argument("--trl-longtail", help="bench/peers/trl_grpo.py --lengths longtail output")
    c.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    {"run": cmd_run, "combine": cmd_combine}[args.cmd](args)


if __name__ == "__main__":
    main()
