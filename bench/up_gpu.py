"""`meshrl up RECIPE` with the recipe alone (defaults) beside the hand-tuned bench settings, in one call: per run
the wall time, time to mesh up, step 1 and the steady steps' phases, each service's warm-up and resolved settings
(GetInfo), and each service's peak GPU memory; the goals of issue #38 -> bench/results/up_gpu.json.

    PYTHONPATH=.:protos python3 bench/up_gpu.py --steps 8 --out /tmp/up_gpu.json                     # one GPU
    OMP_NUM_THREADS=1 .venv/bin/python bench/up_gpu.py --recipe examples/arith/grpo.yaml --steps 5 \
        --out /tmp/up_cpu.json                                                                          # CPU smoke

Each run is the `meshrl` command itself in a subprocess (`python -m coordinator.cli up RECIPE --run.num_steps N
--run.run_dir DIR`, plus the tuned flags for `tuned`); nothing of the mesh runs in this process. While a run's mesh
is up, its services answer GetInfo (details `resolved`, `warmup_seconds`); `nvidia-smi` is sampled every
--memory-interval seconds and each process's memory is put to its role by the process tree of the `meshrl up`
child (a service is `python -m services.<role>`, coordinator/cli/launcher.py). The JSON is written after each run, so
a call cut short keeps the runs that ended.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from bench.peers.mesh_watch import (MemorySampler, get_infos, merge_infos, nvidia_smi,  # noqa: E402
                                    read_bytes)
from bench.peers.settings import median  # noqa: E402

# The settings the issue asks to see resolved, present (null when unknown) in every `resolved` map.
REQUIRED_RESOLVED = ("rollout.kv_cache", "rollout.cuda_graphs", "weight_sync.transport")
GOALS = {"steady_step_le_6s": 6.0, "weight_sync_le_0_2s": 0.2, "step1_le_1_5x_steady": 1.5,
         "default_over_tuned_le_1_10": 1.10}
MESH_UP = re.compile(r"mesh up: (\{.*\}) \(logs in (.*)\)\s*$")
RUN_END = re.compile(r"^run (\S+) (\w+) after (\d+) steps; metrics in (\S+)")
# bench/provenance.py's SOURCES entry for up_gpu.json (used when that file has none).
# Qwen2.5-1.5B's shape, for building the random model when examples/gpu/make_model.py is not there.
QWEN25_15B = dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                  intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6,
                  max_position_embeddings=4096, rope_theta=1000000.0)


# ---- pure parts (tests/unit/test_up_gpu_bench.py) ------------------------------------------------------------

def parse_mesh_up(line: str) -> dict[str, list[str]] | None:
    """The addresses `meshrl up` prints once every service serves: `mesh up: {"trainer": [...], ...} (logs in X)`."""
    m = MESH_UP.search(line)
    if not m:
        return None
    try:
        return {**json.loads(m.group(1)), "_logs": m.group(2)}
    except json.JSONDecodeError:
        return None


def parse_run_end(line: str) -> dict | None:
    """`run ID STATE after N steps; metrics in DIR` (the last lines of `meshrl up`)."""
    m = RUN_END.search(line.strip())
    return {"run_id": m.group(1), "state": m.group(2), "steps": int(m.group(3)), "run_dir": m.group(4)} if m else None


def load_step_records(path: Path) -> list[dict]:
    """The training steps of a metrics.jsonl (records with `time/step`; evaluation-only records dropped), by step."""
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:   # a line cut by a killed run
            continue
        if isinstance(rec.get("time/step"), (int, float)) and rec.get("step") is not None and rec["step"] >= 1:
            rows.append(rec)
    return sorted(rows, key=lambda r: r["step"])


def _finite(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def summarize_steps(records: list[dict], warmup: int) -> dict:
    """Step 1, the steady steps (step > warmup): median step time, each `time/<phase>` median, samples/s."""
    phases = sorted({k[5:] for r in records for k in r if k.startswith("time/") and k != "time/step"})
    steady = [r for r in records if r["step"] > warmup]
    first = next((r for r in records if r["step"] == 1), None)

    def med(rows, key):
        xs = [v for v in (_finite(r.get(key)) for r in rows) if v is not None]
        return median(xs) if xs else None

    steady_step = med(steady, "time/step")
    step1 = _finite(first["time/step"]) if first else None
    samples = med(steady, "samples_per_s")
    return {
        "num_steps": len(records), "warmup_steps": warmup, "steady_steps": len(steady),
        "step1_seconds": step1,
        "steady_step_seconds_median": steady_step,
        "step1_over_steady": step1 / steady_step if step1 is not None and steady_step else None,
        "warmup_steps_seconds": [_finite(r["time/step"]) for r in records if r["step"] <= warmup],
        "phase_seconds_median": {p: med(steady, f"time/{p}") for p in phases},
        "phase_seconds_step1": {p: _finite(first.get(f"time/{p}")) for p in phases} if first else {},
        "weight_sync_seconds_median": med(steady, "time/weight_sync"),
        "samples_per_s_median": samples,
        "steps": [{"step": r["step"], "seconds": _finite(r["time/step"]),
                   **{p: _finite(r.get(f"time/{p}")) for p in phases}} for r in records],
    }


def run_timeout(per_run: float, budget: float | None, elapsed: float, runs_left: int, reserve: float = 20.0) -> float:
    """Seconds the next run may take: --timeout-per-run, or less, its even share of the budget still left (less a
    reserve for stopping it and writing the JSON)."""
    if budget is None:
        return per_run
    return max(30.0, min(per_run, (budget - elapsed - reserve * runs_left) / max(1, runs_left)))


def goal(value: float | None, limit: float) -> dict:
    return {"value": value, "limit": limit, "met": None if value is None else bool(value <= limit)}


def compute_goals(defaults: dict | None, tuned: dict | None) -> tuple[float | None, dict]:
    """(default_over_tuned, goals): the defaults run's steady step, weight sync and step 1 against issue #38's
    limits, and its steady step over the tuned run's of the same call."""
    d, t = defaults or {}, tuned or {}
    ds, ts = d.get("steady_step_seconds_median"), t.get("steady_step_seconds_median")
    ratio = ds / ts if ds is not None and ts else None
    return ratio, {"steady_step_le_6s": goal(ds, GOALS["steady_step_le_6s"]),
                   "weight_sync_le_0_2s": goal(d.get("weight_sync_seconds_median"), GOALS["weight_sync_le_0_2s"]),
                   "step1_le_1_5x_steady": goal(d.get("step1_over_steady"), GOALS["step1_le_1_5x_steady"]),
                   "default_over_tuned_le_1_10": goal(ratio, GOALS["default_over_tuned_le_1_10"])}


# A line of the header the coordinator writes atop the run's recipe.yaml (coordinator/recipe/run_settings.py
# resolved_recipe): `#   rollout.cuda_graphs: auto -> true on the rollout-0 (CUDA device, torch engine)`.
RECIPE_CHOICE = re.compile(r"^#\s+(\S+): (.*?) -> (.*?) on the (.*?) \((.*)\)\s*$")


def _scalar(text: str):
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse_recipe_choices(text: str) -> dict[str, dict]:
    """The `auto` choices in the comment atop a run's recipe.yaml: {key: {value, asked, why, on}}; a key the
    replicas resolved differently keeps its first group and lists every group under `groups`."""
    out: dict[str, dict] = {}
    for line in text.splitlines():
        if not line.startswith("#"):
            if line.strip():
                break            # the header ends where the YAML starts
            continue
        m = RECIPE_CHOICE.match(line)
        if not m:
            continue
        key, asked, value, on, why = m.groups()
        entry = {"value": _scalar(value), "asked": _scalar(asked), "why": why, "on": on}
        if key in out:
            out[key].setdefault("groups", [dict(out[key])]).append(entry)
        else:
            out[key] = entry
    return out


def merge_resolved(infos: dict[str, list[dict]], recipe_text: str | None = None) -> dict:
    """One map `section.key -> {value, asked, why, source}`: the coordinator's header atop the run's recipe.yaml
    first (its weight_sync.transport is per rollout replica), then every service's GetInfo `resolved` (the first
    replica that reports a key wins; the trainer's `per replica` placeholder gives way to the transports it chose
    per target), then the recipe.yaml's plain values of the required keys. REQUIRED_RESOLVED keys are always
    present (null when nothing said)."""
    out: dict = {}
    recipe_yaml = None
    if recipe_text:
        for key, entry in parse_recipe_choices(recipe_text).items():
            out[key] = {**entry, "source": "recipe.yaml"}
        try:
            recipe_yaml = yaml.safe_load(recipe_text)
        except yaml.YAMLError:
            recipe_yaml = None
    per_target: dict[str, list] = {}
    for role, replicas in sorted(infos.items()):
        for info in replicas:
            resolved = (info.get("details") or {}).get("resolved")
            if not isinstance(resolved, dict):
                continue
            for key, val in resolved.items():
                entry = dict(val) if isinstance(val, dict) else {"value": val}
                if "[" in key:       # weight_sync.transport[<replica address>]: one choice per target
                    per_target.setdefault(key.split("[", 1)[0], []).append(entry.get("value"))
                if entry.get("value") == "per replica" and key in out:
                    continue
                if key not in out or out[key].get("value") == "per replica":
                    out[key] = {**entry, "source": f"{role} GetInfo"}
    for key, values in per_target.items():
        if key not in out or out[key].get("value") == "per replica":
            out[key] = {"value": values[0] if len(set(map(str, values))) == 1 else values, "asked": "auto",
                        "why": "the trainer's choice per rollout replica", "source": "trainer GetInfo"}
    if isinstance(recipe_yaml, dict):
        for key in REQUIRED_RESOLVED:
            node = recipe_yaml
            for part in key.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            if node is not None and key not in out:
                out[key] = {"value": node, "asked": None, "why": "the run's recipe.yaml", "source": "recipe.yaml"}
    for key in REQUIRED_RESOLVED:
        out.setdefault(key, None)
    return out


def tuned_flags(recipe: dict) -> list[str]:
    """What the benches set by hand (bench/e2e_grpo.py's recipe on CUDA): CUDA-graph decode, weights through CUDA
    IPC, the compiled actor, and a rollout batch that holds a replica's whole share of the step. On a CPU recipe
    only the batch size applies."""
    rollout = recipe.get("rollout") or {}
    data = recipe.get("data") or {}
    replicas = max(1, int(rollout.get("replicas", 2)))
    rows = int(data.get("rollout_batch_size", 1)) * int(rollout.get("n", 1))
    flags = ["--rollout.max_batch_size", str(max(64, -(-rows // replicas)))]
    if str((recipe.get("model") or {}).get("device", "cpu")).startswith("cuda"):
        flags = ["--rollout.cuda_graphs", "true", "--weight_sync.transport", "ipc", "--actor.compile", "true", *flags]
    return flags


def warmup_seconds(infos: dict[str, list[dict]]) -> dict[str, float | list | None]:
    """details["warmup_seconds"] per role (a list where a role has several replicas), null where absent."""
    out: dict = {}
    for role, replicas in sorted(infos.items()):
        vals = [_finite((r.get("details") or {}).get("warmup_seconds")) for r in replicas]
        out[role] = vals[0] if len(vals) == 1 else vals
    return out


# ---- one `meshrl up` ----------------------------------------------------------------------------------------

def meshrl_command() -> list[str]:
    """The `meshrl` command as this Python runs it (no console script needed: the GPU machine has no venv)."""
    return [sys.executable, "-m", "coordinator.cli"]


def _die_with_parent(cmd: list[str]) -> list[str]:
    # As coordinator/cli/launcher.py: if this bench is killed (the session's `timeout`), `meshrl up` gets SIGTERM and
    # takes its services with it.
    return ["setpriv", "--pdeathsig", "TERM", "--", *cmd] if shutil.which("setpriv") else cmd


# The `meshrl up` child running now: a SIGTERM to this bench (the session's `timeout`) stops it and its services.
_ACTIVE: list[subprocess.Popen] = []


def _on_sigterm(signum, frame):
    for proc in _ACTIVE:
        _stop(proc, grace=5.0)
    raise SystemExit(128 + signum)


def run_up(name: str, recipe: Path, flags: list[str], *, steps: int, warmup: int, work: Path, timeout: float,
           memory_interval: float, shared_compile_cache: bool = False) -> dict:
    """One `meshrl up RECIPE --run.num_steps N --run.run_dir DIR FLAGS...` to its end (or --timeout-per-run)."""
    run_root = work / name
    if run_root.exists():
        shutil.rmtree(run_root)
    run_root.mkdir(parents=True)
    args = ["up", str(recipe), "--run.num_steps", str(steps), "--run.run_dir", str(run_root / "runs"), *flags]
    cmd = meshrl_command() + args
    # COLUMNS: rich prints the `run ... metrics in DIR` line whole instead of wrapping it at 80 columns.
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="1000")
    if not shared_compile_cache:
        # Each run compiles from a cold cache, as a first `meshrl up` on a fresh machine does: the second run of
        # the call gains no start-up or step 1 from the first's inductor and Triton caches.
        env["TORCHINDUCTOR_CACHE_DIR"] = str(run_root / "inductor-cache")
        env["TRITON_CACHE_DIR"] = str(run_root / "triton-cache")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), str(REPO / "protos"), os.environ.get("PYTHONPATH"))
                                        if p)
    log_path = run_root / "meshrl-up.log"
    print(f"== up_gpu {name}: meshrl {' '.join(args)}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(_die_with_parent(cmd), cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    _ACTIVE.append(proc)
    sampler = MemorySampler(proc.pid, memory_interval).start()
    state: dict = {"mesh_up_seconds": None, "addresses": None, "infos": {}, "end": None, "run_id": None,
                   "resolved_lines": []}
    info_threads: list[threading.Thread] = []

    def query(addresses):
        # Again after each step: the trainer records its weight transport per replica at the first push.
        state["infos"] = merge_infos(state["infos"], get_infos(addresses))

    def requery():
        if state["addresses"] and not any(th.is_alive() for th in info_threads):
            th = threading.Thread(target=query, args=(state["addresses"],), daemon=True)
            th.start()
            info_threads.append(th)

    def pump():
        with log_path.open("w") as log:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if state["addresses"] is None and (up := parse_mesh_up(line)):
                    state["mesh_up_seconds"] = time.perf_counter() - t0
                    state["addresses"] = {k: v for k, v in up.items() if k != "_logs"}
                    state["logs"] = up["_logs"]
                    print(f"   mesh up after {state['mesh_up_seconds']:.1f}s", flush=True)
                    requery()
                elif line.startswith("resolved: "):
                    state["resolved_lines"].append(line[len("resolved: "):].rstrip())
                    print("  ", line.rstrip(), flush=True)
                elif m := re.match(r"run (\S+) started", line.strip()):
                    state["run_id"] = m.group(1)
                elif end := parse_run_end(line):
                    state["end"] = end
                elif m := re.match(r"step\s+(\d+)/", line.strip()):
                    print("  ", line.rstrip(), flush=True)
                    if int(m.group(1)) <= 2:   # after the first pushes; later steps run unobserved
                        requery()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        print(f"   {name}: still running after {timeout:.0f}s (--timeout-per-run): stopping it", flush=True)
        _stop(proc)
        rc = proc.returncode
    finally:
        if proc.returncode is None:   # interrupted: leave nothing running on the GPU
            _stop(proc, grace=5.0)
        _ACTIVE.remove(proc)
    wall = time.perf_counter() - t0
    reader.join(timeout=10)
    for th in info_threads:
        th.join(timeout=30)
    sampler.stop()

    run_dir = _find_run_dir(state, run_root / "runs")
    metrics_file = run_dir / "metrics.jsonl" if run_dir else None
    records = load_step_records(metrics_file) if metrics_file and metrics_file.is_file() else []
    recipe_text = None
    if run_dir and (run_dir / "recipe.yaml").is_file():
        recipe_text = (run_dir / "recipe.yaml").read_text()
    out = {"command": ["meshrl", *args], "flags": flags, "rc": rc, "timed_out": timed_out,
           "timeout_seconds": timeout, "compile_cache": "shared" if shared_compile_cache else "cold, this run's own", "wall_seconds": wall, "mesh_up_seconds": state["mesh_up_seconds"],
           "run_id": state["run_id"], "state": (state["end"] or {}).get("state"),
           "run_dir": str(run_dir) if run_dir else None, "log": str(log_path),
           **summarize_steps(records, warmup),
           "warmup_seconds": warmup_seconds(state["infos"]),
           "resolved": merge_resolved(state["infos"], recipe_text),
           "resolved_lines": state["resolved_lines"],
           "services": state["infos"],
           "gpu_memory": sampler.result()}
    if rc != 0 or not records:
        out["log_tail"] = log_path.read_text().splitlines()[-25:]
    print(f"   {name}: rc={rc} in {wall:.0f}s, {len(records)} steps, step 1 {_fmt(out['step1_seconds'])}, "
          f"steady {_fmt(out['steady_step_seconds_median'])}", flush=True)
    return out


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}s"


def _stop(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM to the `meshrl up` child's process group (it and its services), SIGKILL after `grace`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


def _find_run_dir(state: dict, runs: Path) -> Path | None:
    """The run directory `meshrl up` named at its end, else the run id's folder, else the newest with metrics."""
    if state.get("end") and Path(state["end"]["run_dir"]).is_dir():
        return Path(state["end"]["run_dir"])
    if state.get("run_id") and (runs / state["run_id"]).is_dir():
        return runs / state["run_id"]
    found = sorted(runs.glob("*/metrics.jsonl"), key=lambda p: p.stat().st_mtime)
    return found[-1].parent if found else None


# ---- the model, the machine ---------------------------------------------------------------------------------

def ensure_model(recipe: dict, shape: str) -> dict:
    """Builds the recipe's model folder when it is missing: examples/gpu/make_model.py --shape SHAPE, or (before
    that script exists) a random Qwen2 of the shape with the arith tokenizer (bench/peers/settings.py)."""
    model = recipe.get("model") or {}
    path = Path(model.get("path", ""))
    path = path if path.is_absolute() else REPO / path
    if (path / "config.json").is_file():
        return {"path": str(path), "built": False}
    t0 = time.perf_counter()
    script = REPO / "examples" / "gpu" / "make_model.py"
    if script.is_file():
        how = f"examples/gpu/make_model.py --shape {shape}"
        dtype = ["--dtype", model["dtype"]] if model.get("dtype") in ("bfloat16", "float16", "float32") else []
        got = subprocess.run([sys.executable, str(script), "--shape", shape, "--out", str(path), *dtype], cwd=REPO,
                             env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "protos"),
                                                                               os.environ.get("PYTHONPATH", "")])))
        if got.returncode != 0:
            raise SystemExit(f"up_gpu: {how} --out {path} failed (exit {got.returncode}); no model, no runs")
    else:
        from bench.peers.settings import RANDOM_MODELS, make_random_model

        shapes = {**RANDOM_MODELS, "qwen2.5-1.5b": QWEN25_15B}
        if shape not in shapes:
            raise SystemExit(f"--shape: no model at {path} and no shape {shape!r} to build it "
                             f"(one of {', '.join(shapes)})")
        how = f"bench/peers/settings.py make_random_model ({shape})"
        make_random_model(path, dtype=str(model.get("dtype", "bfloat16")), shape=shapes[shape])
    return {"path": str(path), "built": True, "built_by": how, "build_seconds": time.perf_counter() - t0}


def device_name() -> str:
    rows = nvidia_smi("--query-gpu=name")
    if rows:
        return rows[0][0] if len(rows) == 1 else f"{len(rows)} x {rows[0][0]}"
    cpu = next((line.split(":", 1)[1].strip() for line in read_bytes("/proc/cpuinfo").decode(errors="replace").splitlines()
                if line.startswith("model name")), platform.machine())
    return f"cpu: {cpu}, {os.cpu_count()} cores"


def versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "grpcio", "triton"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def build_result(args, recipe: dict, model: dict, runs: dict) -> dict:
    rollout, data = recipe.get("rollout") or {}, recipe.get("data") or {}
    ratio, goals = compute_goals(runs.get("defaults"), runs.get("tuned"))
    result = {
        "bench": "up_gpu", "issue": 38,
        "device": device_name(), "shape": args.shape, "recipe": str(args.recipe),
        "model": model, "versions": versions(),
        "settings": {"prompts_per_step": data.get("rollout_batch_size"), "n": rollout.get("n"),
                     "batch": (data.get("rollout_batch_size") or 0) * (rollout.get("n") or 0),
                     "max_new_tokens": rollout.get("max_tokens"), "rollout_replicas": rollout.get("replicas"),
                     "model_device": (recipe.get("model") or {}).get("device"),
                     "dtype": (recipe.get("model") or {}).get("dtype"),
                     "steps": args.steps, "warmup_steps": args.warmup, "order": args.order,
                     "budget_seconds": args.budget, "timeout_per_run_seconds": args.timeout_per_run,
                     "heldout_files": data.get("heldout_files") or [],
                     "tuned_flags": tuned_flags(recipe) if args.tuned_flags is None else args.tuned_flags.split()},
        "runs": runs,
        "resolved": (runs.get("defaults") or {}).get("resolved"),
        "default_over_tuned": ratio,
        "goals": goals,
        "goals_definition": "defaults run: steady step (median of steps after --warmup) <= 6 s, time/weight_sync "
                            "median <= 0.2 s, step 1 / steady step <= 1.5; defaults steady / tuned steady <= 1.10 "
                            "(issue #38: Qwen2.5-1.5B shape, 32 prompts x 8 samples, 512 new tokens, one GPU)",
    }
    from bench.provenance import stamp

    return stamp("up_gpu", result)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", type=Path, default=Path("examples/gpu/grpo.yaml"))
    ap.add_argument("--shape", default="qwen2.5-1.5b", help="the model shape the recipe's model folder is built "
                    "with when missing (examples/gpu/make_model.py --shape)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the steady median (step 1 included)")
    ap.add_argument("--order", default="defaults,tuned", help="which runs, in which order (defaults, tuned)")
    ap.add_argument("--tuned-flags", default=None,
                    help="the tuned run's flags, one string (default: tuned_flags() of the recipe)")
    ap.add_argument("--timeout-per-run", type=float, default=600.0,
                    help="seconds one `meshrl up` may take before it is stopped (its steps so far are kept)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole bench (model build included): each run gets at most its share of "
                         "what is left, so the last run still starts and the JSON is written")
    ap.add_argument("--shared-compile-cache", action="store_true",
                    help="let the runs share inductor/Triton caches (default: each compiles cold)")
    ap.add_argument("--memory-interval", type=float, default=0.5)
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/meshrl-up-gpu"))
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "up_gpu.json")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    signal.signal(signal.SIGTERM, _on_sigterm)
    order = [x.strip() for x in args.order.split(",") if x.strip()]
    bad = [x for x in order if x not in ("defaults", "tuned")] or (len(set(order)) != len(order) and order)
    if bad or not order:
        raise SystemExit(f"--order: expected defaults and/or tuned, comma separated, each once; got {args.order!r}")
    recipe_path = args.recipe if args.recipe.is_absolute() else REPO / args.recipe
    if not recipe_path.is_file():
        raise SystemExit(f"--recipe: {args.recipe} does not exist")
    recipe = yaml.safe_load(recipe_path.read_text()) or {}
    model = ensure_model(recipe, args.shape)
    flags = {"defaults": [], "tuned": tuned_flags(recipe) if args.tuned_flags is None else args.tuned_flags.split()}
    args.work_dir.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    runs: dict = {}
    for i, name in enumerate(order):
        timeout = run_timeout(args.timeout_per_run, args.budget, time.perf_counter() - started, len(order) - i)
        runs[name] = run_up(name, recipe_path, flags[name], steps=args.steps, warmup=args.warmup,
                            work=args.work_dir, timeout=timeout, memory_interval=args.memory_interval,
                            shared_compile_cache=args.shared_compile_cache)
        result = build_result(args, recipe, model, runs)
        args.out.write_text(json.dumps(result, indent=1) + "\n")   # after each run: a cut call keeps what ended
    print(f"up_gpu: default_over_tuned {result['default_over_tuned']}; goals "
          + ", ".join(f"{k} {'met' if g['met'] else 'not met' if g['met'] is False else 'n/a'}"
                      for k, g in result["goals"].items()) + f" -> {args.out}", flush=True)
    return 0 if all(r["rc"] == 0 for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
