"""Several LoRA runs on one mesh at once against the same runs one after another, on the same mesh (issue #45's
measure): aggregate samples/s of K concurrent runs over that of K sequential runs.

One mesh of the arith LoRA recipe serves every phase. `--mesh inprocess` (the default): trainer, reward and rollout
replicas as servers in this process (services/local.py), the runs driven by a RunManager here, as the coordinator
does; every service shares this process's GIL (and, on a GPU, its CUDA default stream). `--mesh processes`: the mesh
as a user starts it, `meshrl mesh RECIPE` (coordinator/cli/mesh.py: every service its own process, its record in a
mesh file under a temporary XDG_CACHE_HOME, never the user's), the runs started and followed through its
coordinator's run API (coordinator/client.py: StartRun, StreamMetrics, GetRun), the mesh stopped at the end, on
error too. Phases alternate (sequential, concurrent, concurrent, sequential) so a drift of the machine falls on both;
each phase's runs are K copies of the recipe with their own learning rates. The JSON holds the mesh kind, every
phase's wall time and samples, and the ratio of the medians.

    OMP_NUM_THREADS=1 .venv/bin/python bench/many_runs.py --shared     # -> bench/results/many_runs_cpu.json

On a GPU (`--device cuda`), the same recipe over a random-weight Qwen2.5-shaped model folder
(examples/gpu/make_model.py --shape qwen2.5-0.5b), bfloat16, one rollout replica with the CUDA-graph decode and
an adapter slot per run, and longer answers (`--max-tokens`), 4 runs:

    python bench/many_runs.py --device cuda --runs 4 --out $OUT/many_runs_gpu.json   # bench/gpu_session.sh manyruns
    python bench/many_runs.py --device cuda --runs 4 --mesh processes ...       # MANY_MESH=processes there
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "protos")]

from bench.provenance import stamp  # noqa: E402
from meshrl.v1 import common_pb2, trainer_pb2_grpc  # noqa: E402
from coordinator.cli.launcher import _die_with_parent  # noqa: E402
from coordinator.cli.mesh import DETACH_WAIT_S, STOP_WAIT_S  # noqa: E402
from coordinator.client import Client  # noqa: E402
from coordinator.runapi.runs import RunManager  # noqa: E402
from coordinator.runapi.store import MemoryStore  # noqa: E402
from services.local import start_local_mesh  # noqa: E402
from services.trainer.config import ActorConfig  # noqa: E402

DONE = {"COMPLETED", "FAILED", "STOPPED"}


def recipe(run_dir: Path, args) -> dict:
    data = yaml.safe_load((REPO / "examples/arith/grpo_lora.yaml").read_text())
    data["rollout"]["replicas"] = args.replicas
    data["run"].update(num_steps=args.steps, eval_every=0, run_dir=str(run_dir), checkpoint_every=0)
    if args.merge_wait_passes is not None:
        data.setdefault("actor", {})["merge_wait_passes"] = args.merge_wait_passes
    if args.device != "cpu":
        data["model"] = {"path": str(args.model_path), "device": args.device, "dtype": "bfloat16"}
        data["rollout"].update(max_tokens=args.max_tokens, max_loras=max(4, args.runs), kv_cache=args.kv_cache)
        data["data"]["rollout_batch_size"] = args.batch
        # A trainer serving several runs' adapters runs eager (actor.compile: auto goes eager at the second run's
        # adapter, adapter_set.check_new): both phases run eager from the start, so the ratio compares like with like.
        data.setdefault("actor", {})["compile"] = False
    return data


def device_name(device: str) -> str:
    if device == "cpu":
        return "cpu"
    import torch
    return torch.cuda.get_device_name(torch.device(device))


def run_yaml(config: dict, name: str, lr: float) -> str:
    return yaml.safe_dump({**config, "run": {**config["run"], "name": name}, "actor": {**config["actor"], "lr": lr}})


def step_times(run_dir: str) -> dict:
    """The mean of each time/* metric over the run's steps (metrics.jsonl): where a step's seconds went."""
    from coordinator.client import metrics_file

    try:
        rows = metrics_file(run_dir)
    except OSError:
        return {}
    keys = sorted({k for r in rows for k in r if k.startswith("time/")})
    return {k: round(statistics.mean(r[k] for r in rows if k in r), 4) for k in keys}


class LocalRuns:
    """The runs of the in-process mesh: a RunManager in this process, polled until a run ends."""

    def __init__(self, manager: RunManager):
        self.manager = manager

    async def start_run(self, text: str) -> str:
        return await self.manager.start_run(text)

    async def wait(self, run_id: str):
        while (rec := await self.manager.get(run_id)).state not in DONE:
            await asyncio.sleep(0.1)
        return rec


class MeshRuns:
    """The runs of a process mesh, through its coordinator's run API as a script drives them: StartRun, then
    StreamMetrics until the run ends (the coordinator closes the stream once the run has freed what it held) and
    GetRun. The client blocks: each call runs in a thread, so the runs of a phase are followed at once."""

    def __init__(self, client: Client, trainer: str | None = None):
        self.client = client
        self.trainer = trainer

    def trainer_counts(self) -> dict[str, int]:
        """The trainer's counts of calls, commands and merged calls (GetInfo: reference_*, logprobs_*, train_*)."""
        if not self.trainer:
            return {}
        with grpc.insecure_channel(self.trainer) as channel:
            info = trainer_pb2_grpc.TrainerStub(channel).GetInfo(common_pb2.GetInfoRequest(), timeout=30)
        return {k: int(v) for k, v in info.details.items()
                if k.split("_")[0] in ("train", "reference", "logprobs") and v.isdigit()}

    async def start_run(self, text: str) -> str:
        return await asyncio.to_thread(self.client.start_run, text)

    async def wait(self, run_id: str):
        return await asyncio.to_thread(self.client.wait, run_id)


async def finished(runs: LocalRuns | MeshRuns, run_id: str) -> dict:
    rec = await runs.wait(run_id)
    return {"run_id": run_id, "state": rec.state, "steps": rec.step, "message": rec.message,
            "time_mean": step_times(rec.run_dir)}


async def phase(manager: LocalRuns | MeshRuns, config: dict, runs: int, concurrent: bool, tag: str) -> dict:
    """K runs, all at once or one after another; wall time from the first StartRun to the last run's end."""
    lrs = [1e-3, 3e-4, 5e-4, 2e-3][:runs]
    counts = getattr(manager, "trainer_counts", dict)
    before = await asyncio.to_thread(counts)
    t0 = time.perf_counter()
    ends = []
    if concurrent:
        ids = [await manager.start_run(run_yaml(config, f"{tag}-{i}", lr)) for i, lr in enumerate(lrs)]
        ends = await asyncio.gather(*(finished(manager, r) for r in ids))
    else:
        for i, lr in enumerate(lrs):
            ends.append(await finished(manager, await manager.start_run(run_yaml(config, f"{tag}-{i}", lr))))
    seconds = time.perf_counter() - t0
    after = await asyncio.to_thread(counts)
    per_step = config["data"]["rollout_batch_size"] * config["rollout"]["n"]
    samples = sum(e["steps"] for e in ends) * per_step
    assert all(e["state"] == "COMPLETED" for e in ends), ends
    keys = sorted({k for e in ends for k in e["time_mean"]})
    times = {k: round(statistics.mean(e["time_mean"][k] for e in ends if k in e["time_mean"]), 4) for k in keys}
    return {"mode": "concurrent" if concurrent else "sequential", "seconds": round(seconds, 2), "samples": samples,
            "samples_per_s": round(samples / seconds, 2), "step_time_means": times,
            "trainer_counts": {k: v - before.get(k, 0) for k, v in after.items()}, "runs": ends}


@contextlib.asynccontextmanager
async def inprocess_mesh(config: dict, args):
    """Every service a server in this process; yields the runs' driver and the runs' config (the servers' addresses
    in it)."""
    mesh = await start_local_mesh(config, num_rollout=args.replicas, num_reference=0)
    manager = RunManager(MemoryStore())
    try:
        yield LocalRuns(manager), mesh.config
    finally:
        await manager.close()
        await mesh.stop()


@contextlib.asynccontextmanager
async def process_mesh(config: dict, work: Path, threads: int, keep_log: str | None = None):
    """`meshrl mesh RECIPE` as a child of this process, as a user starts it; yields the runs' driver and the runs'
    config (the recipe: the coordinator fills in its services, as for `meshrl run`). The recipe file carries every
    setting of recipe(). The mesh records its coordinator in `work`/cache (XDG_CACHE_HOME), not the user's mesh file.
    Its output and its services' logs are copied to folder `keep_log` once it stops (--mesh-log). It is stopped on the way out, error or not (SIGTERM: it stops its services, coordinator/cli/launcher.py); if this
    process dies first, the kernel SIGTERMs it (setpriv's death signal, as the launcher's own children get)."""
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    # XDG_CACHE_HOME moves the mesh file; Hugging Face's cache (which follows it by default) stays where it was.
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    env = dict(os.environ, XDG_CACHE_HOME=str(work / "cache"),
               HF_HOME=os.environ.get("HF_HOME") or f"{cache}/huggingface", PYTHONUNBUFFERED="1", COLUMNS="1000",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), str(REPO / "protos"), os.environ.get("PYTHONPATH"))
                                          if p))
    log = work / "mesh.log"
    with log.open("w") as out:
        proc = subprocess.Popen(_die_with_parent([sys.executable, "-m", "coordinator.cli", "mesh", str(path),
                                                  "--threads", str(threads)]),
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        address = await asyncio.to_thread(recorded_coordinator, proc, work / "cache" / "meshrl" / "mesh.json", log)
        print(json.dumps({"mesh": "processes", "coordinator": address, "pid": proc.pid}), flush=True)
        with Client(address) as client:
            yield MeshRuns(client, mesh_trainer(log)), config
    finally:
        stop_mesh(proc)
        if keep_log:                # the mesh's output and its services' logs (run_dir/logs)
            shutil.copytree(work / "runs" / "logs", keep_log, dirs_exist_ok=True)
            shutil.copyfile(log, Path(keep_log, "mesh.log"))


def recorded_coordinator(proc: subprocess.Popen, record: Path, log: Path) -> str:
    """The coordinator's address once the mesh has recorded it (it serves then), as `meshrl mesh --detach` waits."""
    deadline = time.monotonic() + DETACH_WAIT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
            raise RuntimeError(f"the mesh exited with code {proc.returncode} before serving: "
                               f"{lines[-1] if lines else 'no output'}\n" + "\n".join(lines[-30:]))
        try:
            found = json.loads(record.read_text())
            if found.get("pid") == proc.pid:
                return found["coordinator"]
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the mesh did not record its coordinator within {DETACH_WAIT_S:g}s (output: {log})")


def mesh_trainer(log: Path) -> str | None:
    """The trainer's address from the mesh's "mesh up: {...}" line."""
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("mesh up: "):
            return json.loads(line[len("mesh up: "):].rsplit(" (logs in", 1)[0])["trainer"][0]
    return None


def stop_mesh(proc: subprocess.Popen) -> None:
    """SIGTERM, as `meshrl mesh --stop` sends: the mesh stops every service (SIGKILL for one that lingers) and
    exits; SIGKILL to the mesh itself only if it has not within STOP_WAIT_S (its services then get the death signal)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def timed_phases(runs: LocalRuns | MeshRuns, config: dict, args) -> list[dict]:
    if args.warmup:
        # One untimed step of K runs at once first: the compiles, CUDA-graph captures and adapter slots a cold mesh
        # makes on its first steps would otherwise fall on whichever phase runs first.
        warm = {**config, "run": {**config["run"], "num_steps": 1}}
        print(json.dumps({"warmup_s": (await phase(runs, warm, args.runs, True, "warm"))["seconds"]}), flush=True)
    phases = []
    order = (False, True, True, False) if args.rounds == 2 else (True, False)
    for i, concurrent in enumerate(order):
        phases.append(await phase(runs, config, args.runs, concurrent, f"p{i}"))
        print(json.dumps({k: v for k, v in phases[-1].items() if k != "runs"}), flush=True)
    return phases


async def main_async(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        config = recipe(Path(tmp) / "runs", args)
        mesh = (process_mesh(config, Path(tmp), args.threads, args.mesh_log) if args.mesh == "processes"
                else inprocess_mesh(config, args))
        async with mesh as (runs, run_config):
            phases = await timed_phases(runs, run_config, args)
    rate = {m: statistics.median(p["samples_per_s"] for p in phases if p["mode"] == m)
            for m in ("sequential", "concurrent")}
    return {"bench": args.stem, "recipe": "examples/arith/grpo_lora.yaml", "mesh": args.mesh, "runs": args.runs,
            "steps_per_run": args.steps, "rollout_replicas": args.replicas, "device": device_name(args.device),
            "model": config["model"], "max_tokens": config["rollout"]["max_tokens"],
            "kv_cache": config["rollout"].get("kv_cache", "auto"),
            "actor_compile": config.get("actor", {}).get("compile", "auto"),
            "merge_wait_passes": config.get("actor", {}).get(
                "merge_wait_passes", ActorConfig.model_fields["merge_wait_passes"].default),
            "samples_per_step": config["data"]["rollout_batch_size"] * config["rollout"]["n"],
            "rounds": args.rounds, "warmup": args.warmup, "phases": phases, "median_samples_per_s": rate,
            "ratio_concurrent_over_sequential": round(rate["concurrent"] / rate["sequential"], 3),
            **({"threads_per_service": args.threads} if args.mesh == "processes" else {})}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: the model folder of --model-path in bfloat16")
    ap.add_argument("--runs", type=int, default=None, help="runs per phase (default 2 on cpu, 4 on cuda)")
    ap.add_argument("--mesh-log", default=None, help="--mesh processes: a folder to copy the mesh's and its services' logs to at the end")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 8 on cpu, 4 on cuda)")
    ap.add_argument("--rounds", type=int, default=2, choices=(1, 2), help="1: concurrent then sequential (the concurrent phase pays the warm-up); 2: ABBA")
    ap.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="one untimed step of the runs at once before the timed phases (default on)")
    ap.add_argument("--replicas", type=int, default=None, help="rollout replicas (default 2 on cpu, 1 on cuda)")
    ap.add_argument("--model-path", type=Path, default=REPO / "examples/gpu/models/qwen2.5-0.5b",
                    help="cuda: a Hugging Face folder (examples/gpu/make_model.py builds the default)")
    ap.add_argument("--max-tokens", type=int, default=128, help="cuda: rollout.max_tokens")
    ap.add_argument("--batch", type=int, default=16, help="cuda: prompts per step (data.rollout_batch_size), n = 8")
    ap.add_argument("--merge-wait-passes", type=float, default=None,
                    help="actor.merge_wait_passes: how long an update waits for other runs' due updates (default 0.5)")
    ap.add_argument("--kv-cache", default="auto", help="cuda: rollout.kv_cache (auto, paged, none)")
    ap.add_argument("--mesh", default="inprocess", choices=("inprocess", "processes"),
                    help="inprocess: every service in this process; processes: `meshrl mesh` (each service its own "
                         "process), runs through its coordinator's run API")
    ap.add_argument("--threads", type=int, default=1, help="processes: OMP threads per service (meshrl mesh --threads)")
    ap.add_argument("--shared", action="store_true", help="the machine runs other jobs too (recorded)")
    ap.add_argument("--out", default=None, help="default bench/results/many_runs_<cpu|gpu>.json")
    args = ap.parse_args(argv)
    cpu = args.device == "cpu"
    args.runs = args.runs or (2 if cpu else 4)
    args.steps = args.steps or (8 if cpu else 4)
    args.replicas = args.replicas or (2 if cpu else 1)
    args.stem = "many_runs_cpu" if cpu else "many_runs_gpu"
    args.out = args.out or str(REPO / f"bench/results/{args.stem}.json")
    result = stamp(args.stem, asyncio.run(main_async(args)), shared_machine=args.shared)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"concurrent / sequential samples/s: x{result['ratio_concurrent_over_sequential']}  -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
