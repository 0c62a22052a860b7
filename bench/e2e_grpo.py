"""meshrl GRPO end to end through the real mesh, against TRL's GRPOTrainer on the same work.

`run`: every service its own process on 127.0.0.1, as `meshrl up` starts them (coordinator.cli.launcher):
trainer, reference, reward, rollout replicas, coordinator; one run of the shared settings
(bench/peers/settings.py) driven through the run API. Each service runs under bench/peers/mesh_timing.py,
which times RPC handlers and the engine work inside them, so the mesh overhead (coordinator-measured
phase time minus server compute: protobuf on both ends, gRPC transport, weight sync) can be split out.

`combine`: several `run` outputs and several bench/peers/trl_grpo.py outputs (interleaved by
bench/compare.sh) -> one JSON with both sides, medians over runs, the ratio and the reward curves.

    PYTHONPATH=.:protos python bench/e2e_grpo.py run --out /tmp/meshrl.json
    PYTHONPATH=.:protos python bench/e2e_grpo.py run --device cuda --shape qwen2.5-0.5b --out /tmp/meshrl-gpu.json
    PYTHONPATH=.:protos python bench/e2e_grpo.py combine --meshrl a.json b.json --trl c.json d.json --out X.json

Async modes and the long-tailed workload (bench/async_rl.py runs them side by side): `--async-k K` keeps K
batches in flight (run.async_mode, run.max_staleness K), `--partial continue|pause` sets rollout.partial_rollouts,
`--correction bypass|decoupled` algorithm.rollout_correction.mode; `--lengths longtail` stops each sample at a
length drawn from a lognormal (median --length-median, capped at --length-cap new tokens: bench/peers/long_tail.py)
instead of the shape's fixed max_new_tokens.

Placement (`--placement`, with --device cuda): `shared` runs every service on the first visible GPU (weights through
CUDA IPC); `split` runs the rollout replicas on the second GPU (CUDA_VISIBLE_DEVICES=1, as `meshrl up
--rollout.devices 1`) and trainer, reference and reward on the first, the weights through NCCL (`--weight-transport`
overrides), so generation and training no longer time-slice one device.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from bench.provenance import stamp  # noqa: E402
from bench.peers.settings import HELDOUT_FILE, TRAIN_FILE, median, model_path, settings  # noqa: E402
from coordinator.cli import launcher as launcher_mod  # noqa: E402
from coordinator.cli.launcher import Launcher  # noqa: E402

TIMING_MODULE = "bench.peers.mesh_timing"
PHASES = ("generate", "reward", "reference", "old_logprobs", "train", "weight_sync")


# --placement: the index, among the GPUs this process sees, of each role's GPU (absent = inherit all)
PLACEMENTS = {"shared": {}, "split": {"trainer": 0, "reference": 0, "reward": 0, "rollout": 1}}


def placement_devices(name: str) -> dict[str, str]:
    """Each role's CUDA_VISIBLE_DEVICES for --placement, as `meshrl up --<role>.devices` sets it."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return {role: visible[i] if visible else str(i) for role, i in PLACEMENTS[name].items()}


def recipe(s: dict, *, device: str, run_dir: Path, rollout_replicas: int, weight_transport: str = "ipc") -> dict:
    """The run config of the shared settings: examples/arith/grpo.yaml's keys, spelled out."""
    rows = s["prompts_per_step"] * s["n"]
    cuda = device == "cuda"
    return {
        "model": {"path": s["model_path"], "dtype": s["dtype"], "device": device},
        "rollout": {"engine": "torch", "replicas": rollout_replicas, "n": s["n"], "temperature": s["temperature"],
                    "top_p": s["top_p"], "max_tokens": s["max_new_tokens"],
                    # Seeded rows sample on the eager loop; CUDA graphs take unseeded requests only.
                    "seed": None if cuda else s["sampling_seed"], "cuda_graphs": cuda,
                    # A replica's share of the batch decodes as one batch.
                    "max_batch_size": max(64, -(-rows // rollout_replicas))},
        "actor": {"lr": s["lr"], "grad_clip": s["grad_clip"], "weight_decay": s["weight_decay"],
                  "betas": list(s["adam_betas"]), "eps": s["adam_eps"], "lr_schedule": s["lr_schedule"],
                  **({"param_dtype": "float32", "dtype": "bfloat16", "weight_sync_dtype": "bfloat16"} if cuda else {})},
        # One GPU: the replica copies the trainer's staged weights through CUDA IPC (no host round trip); two: NCCL.
        **({"weight_sync": {"transport": weight_transport}} if cuda else {}),
        "reward": {"components": [{"name": "exact_match", "weight": 1.0}]},
        "reference": {"replicas": 1},
        "algorithm": {"adv_estimator": "grpo", "norm_adv_by_std": s["scale_rewards_by_group_std"],
                      "use_kl_loss": s["kl_coef"] > 0, "kl_loss_coef": s["kl_coef"], "kl_loss_type": s["kl_estimator"],
                      "clip_ratio_low": s["clip_ratio"], "clip_ratio_high": s["clip_ratio"],
                      "loss_agg_mode": s["loss_agg"], "ppo_epochs": s["ppo_epochs"], "ppo_mini_batch_size": 0},
        "data": {"train_files": [str(TRAIN_FILE)], "rollout_batch_size": s["prompts_per_step"], "seed": s["data_seed"],
                 "heldout_files": [str(HELDOUT_FILE)] if s["shape"] == "arith" else []},
        "run": {"name": f"e2e-grpo-{s['shape']}", "num_steps": s["steps"], "eval_every": 0, "run_dir": str(run_dir),
                "seed": 0},
    }


class TimedLauncher(Launcher):
    """Launcher whose children run bench/peers/mesh_timing.py (the same `main` of each role, timed)."""

    def __init__(self, *args, instrument: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.instrument = instrument

    def start(self, role: str, index: int = 0, **kwargs):
        if not self.instrument:
            return super().start(role, index, **kwargs)
        saved = launcher_mod.MODULES[role]
        launcher_mod.MODULES[role] = TIMING_MODULE
        os.environ["MESHRL_BENCH_ROLE"] = role     # read by the child; Launcher copies os.environ
        try:
            return super().start(role, index, **kwargs)
        finally:
            launcher_mod.MODULES[role] = saved


def run_mesh(data: dict, config_path: Path, log_dir: Path, *, instrument: bool, threads: int,
             trainer_threads: int | None = None, devices: dict[str, str] | None = None) -> tuple[str, float]:
    """Starts the mesh, runs `data` to the end; returns the run directory and the start-up seconds."""
    from coordinator.cli.runs import _with_addresses
    from coordinator.client import Client

    t0 = time.perf_counter()
    with TimedLauncher(str(config_path), log_dir=log_dir, num_threads=threads, instrument=instrument) as la:
        # `meshrl serve trainer --model.num_threads N`: the trainer alone may take more threads than the rest.
        trainer_args = ["--model.num_threads", str(trainer_threads)] if trainer_threads else []
        dev = devices or {}
        children = [la.start("trainer", extra_args=trainer_args, devices=dev.get("trainer", "")),
                    la.start("reference", devices=dev.get("reference", "")),
                    la.start("reward", devices=dev.get("reward", ""))]
        children += [la.start("rollout", i, devices=dev.get("rollout", "")) for i in range(data["rollout"]["replicas"])]
        children.append(la.start("coordinator"))
        addresses: dict[str, list[str]] = {}
        for c in children:
            addresses.setdefault(c.role, []).append(la.wait_ready(c, timeout=600))
        startup = time.perf_counter() - t0
        with Client(addresses["coordinator"][0]) as client:
            run_data = _with_addresses(copy.deepcopy(data), {}, addresses)
            run_id = client.start_run(yaml.safe_dump(run_data, sort_keys=False))
            for m in client.stream_metrics(run_id):
                if "reward_mean" in m:
                    print(f"meshrl step {int(m['step'])}: reward {m['reward_mean']:.3f} "
                          f"{m['time/step']:.3f}s", flush=True)
            status = client.wait(run_id)
        if status.state != "COMPLETED":
            raise RuntimeError(f"run {run_id} ended {status.state}: {status.message}")
        return status.run_dir, startup


def load_timing(folder: Path) -> list[dict]:
    records = []
    for f in sorted(folder.glob("*.jsonl")):
        records += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return records


def step_overhead(m: dict, window: dict, records: list[dict]) -> dict:
    """Server compute, handler and client seconds of one step's RPCs, and the overhead they leave.

    Concurrent calls (the rollout replicas' Generate; reward || reference || old log-probs) count by
    their longest one, the one the coordinator waits for.
    """
    inside = [r for r in records if window["start"] <= r["start"] <= window["end"]]

    def server(role: str, rpc: str, key: str) -> float:
        xs = [r.get(key, 0.0) for r in inside if r["side"] == "server" and r["role"] == role and r["rpc"] == rpc]
        return max(xs, default=0.0)

    def client(call: str, target: str) -> float:
        return max((r["seconds"] for r in inside if r["side"] == "client" and r["call"] == call and
                    r["target"] == target), default=0.0)

    compute = {"generate": server("rollout", "Generate", "compute_s"), "reward": server("reward", "Score", "compute_s"),
               "reference": server("reference", "ComputeLogProbs", "compute_s"),
               "old_logprobs": server("trainer", "ComputeLogProbs", "compute_s"),
               "train": server("trainer", "TrainActor", "compute_s")}
    handler = {"generate": server("rollout", "Generate", "handler_s"), "reward": server("reward", "Score", "handler_s"),
               "reference": server("reference", "ComputeLogProbs", "handler_s"),
               "old_logprobs": server("trainer", "ComputeLogProbs", "handler_s"),
               "train": server("trainer", "TrainActor", "handler_s")}
    convert = {"generate": server("rollout", "Generate", "convert_s"), "reward": server("reward", "Score", "convert_s"),
               "reference": server("reference", "ComputeLogProbs", "convert_s"),
               "old_logprobs": server("trainer", "ComputeLogProbs", "convert_s"),
               "train": server("trainer", "TrainActor", "convert_s")}
    calls = {"generate": client("generate", "rollout"), "reward": client("score", "reward"),
             "reference": client("logprobs", "reference"), "old_logprobs": client("logprobs", "trainer"),
             "train": client("train_actor", "trainer")}
    phase = {k: m.get(f"time/{k}", 0.0) for k in PHASES}
    # Per phase: what the coordinator waited minus the engine work on the other side.
    overhead = {k: phase[k] - compute[k] for k in compute}
    overhead["weight_sync"] = phase["weight_sync"]   # all of it: a colocated trainer has no weight sync
    concurrent = ("reward", "reference", "old_logprobs")
    critical = (overhead["generate"] + max(phase[k] for k in concurrent) - max(compute[k] for k in concurrent)
                + overhead["train"] + overhead["weight_sync"])
    return {
        "phase_s": phase, "compute_s": compute, "handler_s": handler, "server_convert_s": convert,
        "client_call_s": calls,
        "overhead_s": overhead,
        "overhead_sum_s": sum(overhead.values()),
        "overhead_critical_path_s": critical,
        # Where the non-compute time of the RPC phases goes (summed over the five RPC phases).
        "server_protobuf_s": sum(handler[k] - compute[k] for k in compute),
        "client_protobuf_and_transport_s": sum(calls[k] - handler[k] for k in compute),
        "coordinator_phase_extra_s": sum(phase[k] - calls[k] for k in compute),
        "weight_sync": {
            "trainer_push_handler_s": server("trainer", "PushWeights", "handler_s"),
            "trainer_state_for_sync_s": server("trainer", "PushWeights", "compute_s"),
            "rollout_update_handler_s": server("rollout", "UpdateWeights", "handler_s"),
            "rollout_swap_in_s": server("rollout", "UpdateWeights", "compute_s"),
        },
        "coordinator_local_s": m["time/step"] - (phase["generate"] + max(phase[k] for k in concurrent)
                                                 + phase["train"] + phase["weight_sync"]),
        # Python's garbage collector inside the step's handlers (by RPC) and in the coordinator's step.
        "gc_s": {**{k: server(*rpc, "gc_s") for k, rpc in (("generate", ("rollout", "Generate")),
                                                          ("reference", ("reference", "ComputeLogProbs")),
                                                          ("train", ("trainer", "TrainActor")))},
                 "coordinator_step": window.get("gc_s", 0.0)},
    }


def summarize_run(run_dir: Path, timing: list[dict], s: dict, extra: dict) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if "reward_mean" in r]
    windows = {int(r["step"]): r for r in timing if r["side"] == "step"}
    before = next((r["heldout_accuracy"] for r in records if r.get("step") == 0 and "heldout_accuracy" in r), None)
    after = next((r["heldout_accuracy"] for r in records if r.get("final") and "heldout_accuracy" in r), None)
    rows, prev_ts = [], None
    for m in steps:
        step = int(m["step"])
        row = {"step": step, "reward_mean": m["reward_mean"], "kl": m.get("kl"), "entropy": m.get("actor/entropy"),
               "response_length_mean": m.get("response_length_mean"), "grad_norm": m.get("actor/grad_norm"),
               "response_length_max": m.get("response_length_max"), "staleness_max": m.get("staleness_max"),
               "partial_samples": m.get("async/partial_samples"),
               "step_seconds": m["time/step"], "trainer_seconds": m.get("actor/seconds"),
               # Wall time between two steps' records: the step plus recording, pool refreshes.
               "interval_seconds": m["timestamp"] - prev_ts if prev_ts is not None else None,
               "phases": {k: m.get(f"time/{k}", 0.0) for k in PHASES}}
        if step in windows:
            row["mesh"] = step_overhead(m, windows[step], timing)
        rows.append(row)
        prev_ts = m["timestamp"]
    timed = [r for r in rows if r["step"] > s["warmup_steps"]]
    batch = s["prompts_per_step"] * s["n"]
    step_s = median([r["step_seconds"] for r in timed])
    interval_s = median([r["interval_seconds"] for r in timed])
    total_step = sum(r["step_seconds"] for r in timed)
    shares = {k: sum(r["phases"][k] for r in timed) / total_step for k in PHASES}
    out = {"side": "meshrl", **extra, "settings": s, "run_dir": str(run_dir), "timed_steps": len(timed),
           "seconds_per_step_median": step_s, "interval_seconds_median": interval_s,
           "steps_per_s": 1.0 / interval_s, "samples_per_s": batch / interval_s,
           "heldout_accuracy_before": before, "heldout_accuracy_after": after,
           "phase_seconds_median": {k: median([r["phases"][k] for r in timed]) for k in PHASES},
           # Share of the summed step time; reward, reference and old log-probs overlap, so shares add past 1.
           "phase_time_shares": shares, "steps": rows}
    mesh = [r["mesh"] for r in timed if "mesh" in r]
    if mesh:
        def share(key):
            return sum(x[key] for x in mesh) / total_step

        out["mesh_overhead"] = {
            "definition": "per RPC phase: coordinator time/<phase> - engine seconds on the server (longest of "
                          "concurrent calls); weight_sync counted whole",
            "share_summed_over_phases": share("overhead_sum_s"),
            "share_critical_path": share("overhead_critical_path_s"),
            "by_phase_share": {k: sum(x["overhead_s"][k] for x in mesh) / total_step for k in PHASES},
            "server_protobuf_share": share("server_protobuf_s"),
            "client_protobuf_and_transport_share": share("client_protobuf_and_transport_s"),
            "coordinator_phase_extra_share": share("coordinator_phase_extra_s"),
            "coordinator_local_share": share("coordinator_local_s"),
            "compute_seconds_median": {k: median([x["compute_s"][k] for x in mesh]) for k in mesh[0]["compute_s"]},
            "overhead_seconds_median": {k: median([x["overhead_s"][k] for x in mesh]) for k in PHASES},
            "weight_sync_seconds_median": {k: median([x["weight_sync"][k] for x in mesh]) for k in mesh[0]["weight_sync"]},
            # the handlers' protobuf conversion and the garbage collector's seconds, per phase
            "server_convert_seconds_median": {k: median([x["server_convert_s"][k] for x in mesh])
                                              for k in mesh[0]["server_convert_s"]},
            "gc_seconds_median": {k: median([x["gc_s"][k] for x in mesh]) for k in mesh[0]["gc_s"]},
        }
    return out


def workload_settings(args, s: dict) -> dict:
    """--lengths: the shape's fixed max_new_tokens, or a long-tailed length per sample (the recipe's max_tokens is
    then the cap; the rollout process draws each sample's length, bench/peers/long_tail.py)."""
    if args.lengths == "fixed":
        os.environ.pop("MESHRL_BENCH_LENGTHS", None)
        return {"lengths": "fixed", "max_new_tokens": s["max_new_tokens"]}
    if args.no_instrument:
        raise SystemExit("--lengths longtail: needs the timing wrapper (drop --no-instrument)")
    s["max_new_tokens"] = args.length_cap
    os.environ["MESHRL_BENCH_LENGTHS"] = (f"lognormal:{args.length_median}:{args.length_sigma}:{args.length_cap}:"
                                          f"{s['sampling_seed']}")
    return {"lengths": "longtail", "distribution": "lognormal", "median": args.length_median,
            "sigma": args.length_sigma, "cap": args.length_cap}


def async_settings(args, data: dict) -> dict:
    """--async-k / --partial / --correction into the run config; returns the mode as recorded."""
    if args.async_k:
        data["run"].update(async_mode=True, max_staleness=args.async_k)
    if args.partial:
        if not args.async_k:
            raise SystemExit("--partial: needs --async-k >= 1")
        data["rollout"]["partial_rollouts"] = args.partial
    if args.correction != "off":
        data["algorithm"]["rollout_correction"] = {"mode": args.correction}
    name = "sync" if not args.async_k else f"async-k{args.async_k}" + {None: "", "continue": "-partial",
                                                                      "pause": "-pause"}[args.partial]
    if args.correction != "off":
        name += f"-{args.correction}"
    return {"name": name, "async_k": args.async_k, "partial_rollouts": args.partial or "off",
            "correction": args.correction}


def cmd_run(args) -> None:
    if args.placement == "split" and args.device != "cuda":
        raise SystemExit("--placement split: needs --device cuda (rollout on the second GPU)")
    s = settings(args.shape, steps=args.steps, warmup_steps=args.warmup_steps, sampling_seed=args.seed)
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    s["model_path"] = model_path(s, work)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_root = work / f"meshrl-{stamp}"
    timing_dir = run_root / "timing"
    os.environ["MESHRL_BENCH_TIMING_DIR"] = str(timing_dir)
    # The children import bench.peers.mesh_timing from the repository, wherever this was started from.
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "protos"), os.environ.get("PYTHONPATH", "")])
    if args.rollout_replicas is None:
        args.rollout_replicas = 1 if args.device == "cuda" else 2
    workload = workload_settings(args, s)
    transport = args.weight_transport or ("nccl" if args.placement == "split" else "ipc")
    data = recipe(s, device=args.device, run_dir=run_root / "runs", rollout_replicas=args.rollout_replicas,
                  weight_transport=transport)
    mode = async_settings(args, data)
    config_path = run_root / "e2e_grpo.yaml"
    run_root.mkdir(parents=True, exist_ok=True)
    config_path.write_text(yaml.safe_dump(data, sort_keys=False))
    t0 = time.perf_counter()
    run_dir, startup = run_mesh(data, config_path, run_root / "logs", instrument=not args.no_instrument,
                                threads=args.threads, trainer_threads=args.trainer_threads,
                                devices=placement_devices(args.placement))
    import torch
    import transformers

    extra = {"versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                          "python": platform.python_version()},
             "device": args.device, "threads_per_service": args.threads, "trainer_threads": args.trainer_threads or args.threads, "rollout_replicas": args.rollout_replicas,
             "instrumented": not args.no_instrument, "startup_seconds": startup,
             "seconds_total": time.perf_counter() - t0, "recipe": data, "workload": workload, "mode": mode,
             "placement": args.placement}
    result = summarize_run(Path(run_dir), load_timing(timing_dir), s, extra)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    mo = result.get("mesh_overhead", {})
    print(f"meshrl: {result['timed_steps']} timed steps, {result['seconds_per_step_median']:.3f} s/step "
          f"(interval {result['interval_seconds_median']:.3f}), {result['samples_per_s']:.1f} samples/s, "
          f"mesh overhead {mo.get('share_critical_path', float('nan')):.1%} of step time (critical path)")


# ---- combine ------------------------------------------------------------------------------------------

def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _std(xs):
    xs = [x for x in xs if x is not None]
    if len(xs) < 2:
        return None
    m = sum(xs) / len(xs)
    return (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5


def side_summary(runs: list[dict]) -> dict:
    n_steps = min(len(r["steps"]) for r in runs)
    curve = [_mean([r["steps"][i]["reward_mean"] for r in runs]) for i in range(n_steps)]
    keys = ("seconds_per_step_median", "interval_seconds_median", "steps_per_s", "samples_per_s",
            "heldout_accuracy_before", "heldout_accuracy_after")
    out = {k: median([r[k] for r in runs if r.get(k) is not None]) for k in keys}
    out["per_run"] = {k: [r.get(k) for r in runs] for k in keys + ("seconds_total",)}
    out["phase_seconds_median"] = {k: median([r["phase_seconds_median"][k] for r in runs])
                                   for k in runs[0]["phase_seconds_median"]}
    out["reward_curve_mean_over_runs"] = curve
    out["reward_curves"] = [[s["reward_mean"] for s in r["steps"][:n_steps]] for r in runs]
    if "phase_time_shares" in runs[0]:
        out["phase_time_shares"] = {k: median([r["phase_time_shares"][k] for r in runs]) for k in runs[0]["phase_time_shares"]}
    if all("mesh_overhead" in r for r in runs):
        mo = [r["mesh_overhead"] for r in runs]
        out["mesh_overhead"] = {
            "definition": mo[0]["definition"],
            **{k: median([x[k] for x in mo]) for k in mo[0] if "share" in k and not isinstance(mo[0][k], dict)},
            **{k: {kk: median([x[k][kk] for x in mo]) for kk in mo[0][k]} for k in mo[0] if isinstance(mo[0][k], dict)},
        }
    return out


def reward_agreement(a: list[list[float]], b: list[list[float]], window: int = 10) -> dict:
    """Mean reward over windows of steps per side, the gap, and the run-to-run spread (the noise)."""
    n = min(min(len(c) for c in a), min(len(c) for c in b))
    out = []
    for start in range(0, n, window):
        wa = [sum(c[start:start + window]) / len(c[start:start + window]) for c in a]
        wb = [sum(c[start:start + window]) / len(c[start:start + window]) for c in b]
        out.append({"steps": f"{start + 1}-{min(n, start + window)}", "meshrl": _mean(wa), "trl": _mean(wb),
                    "gap": _mean(wa) - _mean(wb), "meshrl_run_std": _std(wa), "trl_run_std": _std(wb)})
    return {"window_steps": window, "windows": out,
            "all_steps": {"meshrl": _mean([sum(c[:n]) / n for c in a]), "trl": _mean([sum(c[:n]) / n for c in b])}}


def trl_phase_view(t: dict) -> dict:
    """TRL's profiled sections (medians) as the phases of a meshrl step, where they map."""
    ph = t["phase_seconds_median"]
    gen, rewards, prep, loss = (ph.get(k, 0.0) for k in ("transformers.generate", "_calculate_rewards",
                                                          "_prepare_inputs", "compute_loss"))
    return {"generate": gen, "reward": rewards,
            # Tokenising, the reference model's forward, advantages: the rest of _prepare_inputs.
            "reference_and_batch_prep": prep - gen - rewards,
            # The policy forward (no separate old-log-prob pass: num_iterations=1 reuses it) and the loss.
            "policy_forward_and_loss": loss,
            "backward_optimizer_and_rest": t["seconds_per_step_median"] - prep - loss}


def machine() -> dict:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "load_avg_at_combine": load,
            "git_commit": commit}


def portable_recipe(data: dict) -> dict:
    """The recipe without this machine's addresses and temporary folders."""
    data = copy.deepcopy(data)
    for role in ("rollout", "reward", "reference"):
        data.get(role, {}).pop("servers", None)
    data.pop("trainer", None)
    data["run"]["run_dir"] = "<work dir>/runs"
    data["rollout"]["seed"] = "<round>"
    return data


def keep_earlier_calls(result: dict, out: Path) -> None:
    """A new call goes on top; the file's previous headline call and its history move to `earlier_calls`."""
    if not out.exists():
        return
    prev = json.loads(out.read_text())
    m, t, r = prev.get("meshrl", {}), prev.get("trl", {}), prev.get("ratio_meshrl_over_trl", {})
    headline = {"date": prev.get("date"), "git_commit": (prev.get("provenance") or {}).get("commit")
                or (prev.get("machine") or {}).get("git_commit"),
                "meshrl_seconds_per_step": m.get("seconds_per_step_median"),
                "meshrl_samples_per_s": m.get("samples_per_s"),
                "trl_seconds_per_step": t.get("seconds_per_step_median"), "trl_samples_per_s": t.get("samples_per_s"),
                "ratio_steps_per_s": r.get("steps_per_s"), "ratio_samples_per_s": r.get("samples_per_s"),
                "mesh_overhead_share_critical_path": m.get("mesh_overhead", {}).get("share_critical_path"),
                "note": "the file's headline call before a newer one replaced it"}
    result["earlier_calls"] = [headline, *prev.get("earlier_calls", [])]
    for key in ("rechecks",):
        if key in prev:
            result[key] = prev[key]


def cmd_combine(args) -> None:
    mesh = [json.loads(Path(p).read_text()) for p in args.meshrl]
    trl = [json.loads(Path(p).read_text()) for p in args.trl]
    m, t = side_summary(mesh), side_summary(trl)
    s = dict(mesh[0]["settings"])
    s["sampling_seed"] = {"meshrl": [r["settings"]["sampling_seed"] for r in mesh],
                          "trl": [r["settings"]["sampling_seed"] for r in trl]}
    result = {
        "benchmark": "GRPO end to end: meshrl (every service its own process, gRPC) vs TRL GRPOTrainer "
                     "(colocated model.generate, one process)",
        "date": datetime.date.today().isoformat(),
        # runs combined on another machine than the one they ran on (the GPU runs) name theirs
        "machine": {"description": args.machine, "git_commit": machine()["git_commit"]} if args.machine else machine(),
        "settings": {k: s[k] for k in s if k != "model_path"} | {
            "batch": f"{s['prompts_per_step']} prompts x {s['n']} samples",
            "trl": {"loss_type": "dapo", "beta": s["kl_coef"], "scale_rewards": "group", "num_iterations": 1,
                    "steps_per_generation": 1, "shuffle_dataset": False, "use_vllm": False,
                    "threads": trl[0]["settings"]["threads"], "versions": trl[0]["versions"]},
            "meshrl": {"processes": 4 + mesh[0]["rollout_replicas"], "rollout_replicas": mesh[0]["rollout_replicas"],
                       "threads_per_service": mesh[0]["threads_per_service"], "instrumented": mesh[0]["instrumented"],
                       "versions": mesh[0]["versions"], "recipe": portable_recipe(mesh[0]["recipe"])},
        },
        "runs": {"meshrl": len(mesh), "trl": len(trl), "order": args.order or "interleaved"},
        "meshrl": m, "trl": t,
        "ratio_meshrl_over_trl": {
            "steps_per_s": m["steps_per_s"] / t["steps_per_s"],
            "samples_per_s": m["samples_per_s"] / t["samples_per_s"],
            "seconds_per_step_in_step": t["seconds_per_step_median"] / m["seconds_per_step_median"],
        },
        "reward_agreement": reward_agreement(m["reward_curves"], t["reward_curves"]),
    }
    for key, files in (("meshrl_uninstrumented", args.meshrl_plain), ("trl_2_threads", args.trl_threads2)):
        if files:
            extra = side_summary([json.loads(Path(p).read_text()) for p in files])
            result[key] = {k: extra[k] for k in ("steps_per_s", "samples_per_s", "seconds_per_step_median",
                                                   "interval_seconds_median", "per_run", "phase_seconds_median")}
    if "trl_2_threads" in result:
        result["ratio_meshrl_over_trl"]["steps_per_s_vs_trl_2_threads"] = \
            m["steps_per_s"] / result["trl_2_threads"]["steps_per_s"]
    t["phase_view_seconds"] = trl_phase_view(t)
    windows = result["reward_agreement"]["windows"]
    noise = [w[k] for w in windows for k in ("meshrl_run_std", "trl_run_std") if w[k] is not None]
    result["goals"] = {
        "meshrl_steps_per_s_at_least_trl": result["ratio_meshrl_over_trl"]["steps_per_s"] >= 1.0,
        "mesh_overhead_share_critical_path": m.get("mesh_overhead", {}).get("share_critical_path"),
        "reward_window_max_abs_gap": max(abs(w["gap"]) for w in windows),
        "reward_window_run_std_max": max(noise) if noise else None,
    }
    if mesh[0].get("device") == "cuda":  # the GPU goals of the benchmark issue
        result["goals"]["meshrl_samples_per_s_at_least_5x_trl"] = result["ratio_meshrl_over_trl"]["samples_per_s"] >= 5
        result["goals"]["mesh_overhead_under_5_percent"] = (result["goals"]["mesh_overhead_share_critical_path"]
                                                            or 1.0) < 0.05
    keep_earlier_calls(result, args.out)
    # The runs' own stamp (made where they ran, `provenance.py stamp --as`), else this tree's.
    stem = "vs_trl_gpu" if mesh[0].get("device") == "cuda" else "vs_trl_cpu"
    result["provenance"] = mesh[0].get("provenance") or stamp(stem, {})["provenance"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # Paths relative to the repository: the JSON is committed.
    args.out.write_text(json.dumps(result, indent=1).replace(str(REPO) + "/", ""))
    r = result["ratio_meshrl_over_trl"]
    print(f"meshrl {m['steps_per_s']:.2f} steps/s ({m['samples_per_s']:.0f} samples/s) vs TRL {t['steps_per_s']:.2f} "
          f"({t['samples_per_s']:.0f}): x{r['steps_per_s']:.2f}; wrote {args.out}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one meshrl run through the mesh")
    r.add_argument("--shape", default="arith", help="arith (the demo model), qwen2.5-0.5b (random, for GPUs) or tiny-256 "
                   "(the GPU variant's payloads with a tiny random model: mesh overhead on a CPU)")
    r.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    r.add_argument("--steps", type=int)
    r.add_argument("--warmup-steps", type=int, help="steps left out of the timing medians")
    r.add_argument("--seed", type=int, help="sampling seed (rollout.seed); the prompt order stays data_seed's")
    r.add_argument("--rollout-replicas", type=int, help="as `meshrl up` (2 unless the recipe says); 1 on one GPU")
    r.add_argument("--threads", type=int, default=1, help="OMP threads per service process (`meshrl up --threads`)")
    r.add_argument("--trainer-threads", type=int, help="torch threads of the trainer alone (default: --threads)")
    r.add_argument("--no-instrument", action="store_true", help="plain service modules, no RPC timers")
    r.add_argument("--lengths", choices=["fixed", "longtail"], default="fixed",
                   help="fixed: every sample max_new_tokens; longtail: lognormal lengths (bench/peers/long_tail.py)")
    r.add_argument("--length-median", type=float, default=96.0)
    r.add_argument("--length-sigma", type=float, default=1.0)
    r.add_argument("--length-cap", type=int, default=1024)
    r.add_argument("--async-k", type=int, default=0, help="batches in flight (run.max_staleness); 0 = synchronous")
    r.add_argument("--partial", choices=["continue", "pause"], help="rollout.partial_rollouts (with --async-k)")
    r.add_argument("--correction", choices=["off", "bypass", "decoupled"], default="off",
                   help="algorithm.rollout_correction.mode")
    r.add_argument("--placement", choices=sorted(PLACEMENTS), default="shared",
                   help="shared: every service on one GPU; split: rollout on cuda:1, the rest on cuda:0")
    r.add_argument("--weight-transport", choices=["ipc", "nccl", "grpc"],
                   help="weight_sync.transport on cuda (default ipc, nccl with --placement split)")
    r.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "meshrl-bench")
    r.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("combine", help="merge meshrl and TRL run outputs into one result JSON")
    c.add_argument("--meshrl", nargs="+", required=True)
    c.add_argument("--trl", nargs="+", required=True)
    c.add_argument("--meshrl-plain", nargs="*", default=[], help="uninstrumented meshrl runs (timer cost check)")
    c.add_argument("--trl-threads2", nargs="*", default=[], help="TRL runs with 2 threads (both cores)")
    c.add_argument("--order", default="")
    c.add_argument("--machine", help="the machine the runs ran on, in words, when combined elsewhere")
    c.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    {"run": cmd_run, "combine": cmd_combine}[args.cmd](args)


if __name__ == "__main__":
    main()
