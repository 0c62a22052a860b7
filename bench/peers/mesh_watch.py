"""What a running mesh shows from outside (bench/up_gpu.py): the role of each process under `meshrl up`, each
process's GPU memory from nvidia-smi, and its services' GetInfo."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

# The `-m` module of each service process (coordinator/cli/launcher.py MODULES) -> its role; `coordinator.cli` is the
# `meshrl` command itself (the launcher), as is the `meshrl` console script.
MODULE_ROLES = {"coordinator": "coordinator", "coordinator.__main__": "coordinator",
                "services.trainer": "trainer", "services.trainer.__main__": "trainer",
                "services.rollout": "rollout", "services.rollout.__main__": "rollout",
                "services.reward": "reward", "services.reward.__main__": "reward",
                "services.reference": "reference", "services.reference.__main__": "reference",
                "services.env": "env", "services.env.__main__": "env",
                "coordinator.cli": "launcher", "torch.distributed.run": "torchrun"}
SERVE_ROLES = ("coordinator", "trainer", "rollout", "reward", "reference", "env")


def role_of(cmdline: list[str], environ: dict[str, str] | None = None) -> str | None:
    """The meshrl role of a process from its argv: the last known `-m` module (torchrun's ranks and agent name
    the service module after torchrun's own), `meshrl serve ROLE`, `meshrl up` (the launcher), or the bench timing
    wrapper with MESHRL_BENCH_ROLE; None for anything else."""
    modules = [cmdline[i + 1] for i, a in enumerate(cmdline[:-1]) if a == "-m"]
    if "bench.peers.mesh_timing" in modules and environ and environ.get("MESHRL_BENCH_ROLE"):
        return environ["MESHRL_BENCH_ROLE"]
    known = [MODULE_ROLES[m] for m in modules if m in MODULE_ROLES]
    services = [r for r in known if r not in ("launcher", "torchrun")]
    if services:
        return services[-1]
    for i, a in enumerate(cmdline[:-1]):
        if a == "serve" and cmdline[i + 1] in SERVE_ROLES:
            return cmdline[i + 1]
        if a == "up" and (known or Path(cmdline[i - 1] if i else "").name == "meshrl"):
            return "launcher"
    return known[-1] if known else None


def parse_details(details: dict[str, str]) -> dict:
    """GetInfo details with JSON values decoded (`resolved`, numbers); the long `settings` JSON left out."""
    out = {}
    for key, text in details.items():
        if key == "settings":
            continue
        try:
            out[key] = json.loads(text)
        except (json.JSONDecodeError, TypeError):
            out[key] = text
    return out


def read_bytes(path: str) -> bytes:
    """A /proc file's bytes; empty when the process is gone or not ours to read."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def descendants(root: int) -> dict[int, str]:
    """pid -> role of `root` and every process below it (from /proc; roles by role_of, `?` when unknown)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = read_bytes(f"/proc/{entry}/stat").decode(errors="replace")
        # pid (comm) state ppid ...: comm may hold spaces and parentheses, so split after the last ')'
        try:
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out: dict[int, str] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in out:
            continue
        argv = [a.decode(errors="replace") for a in read_bytes(f"/proc/{pid}/cmdline").split(b"\0") if a]
        env = None
        if "bench.peers.mesh_timing" in argv:
            env = dict(kv.decode(errors="replace").split("=", 1) for kv in read_bytes(f"/proc/{pid}/environ").split(b"\0")
                       if b"=" in kv)
        out[pid] = role_of(argv, env) or "?"
        todo += children.get(pid, [])
    return out


def nvidia_smi(*query: str) -> list[list[str]] | None:
    """Rows of `nvidia-smi --query-... --format=csv,noheader,nounits`; None without nvidia-smi or when it fails."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        got = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if got.returncode != 0:
        return None
    return [[c.strip() for c in line.split(",")] for line in got.stdout.splitlines() if line.strip()]


class MemorySampler:
    """Samples nvidia-smi's per-process and whole-GPU memory while a run is up; peaks per role, per pid, total."""

    def __init__(self, root_pid: int, interval: float = 0.5):
        self.root_pid, self.interval = root_pid, interval
        self.available = nvidia_smi("--query-gpu=memory.used") is not None
        self.peak_by_role: dict[str, float] = {}
        self.peak_by_pid: dict[int, dict] = {}
        self.peak_total = 0.0
        self.samples = 0
        self.unmapped_pids: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> MemorySampler:
        if self.available:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=15)

    def sample(self) -> None:
        apps = nvidia_smi("--query-compute-apps=pid,used_memory") or []
        gpus = nvidia_smi("--query-gpu=memory.used") or []
        tree = descendants(self.root_pid)
        by_role: dict[str, float] = {}
        for row in apps:
            try:
                pid, mib = int(row[0]), float(row[1])
            except (IndexError, ValueError):
                continue
            role = tree.get(pid)
            if role is None:   # another process on the GPU, or a pid namespace nvidia-smi does not share with us
                self.unmapped_pids.add(pid)
                continue
            by_role[role] = by_role.get(role, 0.0) + mib
            prev = self.peak_by_pid.get(pid, {"role": role, "mib": 0.0})
            self.peak_by_pid[pid] = {"role": role, "mib": max(prev["mib"], mib)}
        for role, mib in by_role.items():
            self.peak_by_role[role] = max(self.peak_by_role.get(role, 0.0), mib)
        total = sum(float(r[0]) for r in gpus if r and r[0].replace(".", "", 1).isdigit())
        self.peak_total = max(self.peak_total, total)
        self.samples += 1

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception as e:  # noqa: BLE001 - a failed sample must not end the run's measurement
                print(f"up_gpu: memory sample failed: {e}", file=sys.stderr)
            self._stop.wait(self.interval)

    def result(self) -> dict | None:
        if not self.available:
            return None
        return {"peak_mib_by_role": self.peak_by_role or None,
                "peak_mib_by_pid": {str(p): v for p, v in sorted(self.peak_by_pid.items())},
                "peak_mib_gpu_total": self.peak_total, "samples": self.samples,
                "unmapped_pids": sorted(self.unmapped_pids),
                "note": ("nvidia-smi's pids matched none of the run's processes (another pid namespace?): only the "
                         "GPU total is known") if self.samples and not self.peak_by_role else None}


def get_infos(addresses: dict[str, list[str]], timeout: float = 20.0) -> dict[str, list[dict]]:
    """Every service's GetInfo (the coordinator has none), details decoded; an error string where one failed."""
    import grpc

    from meshrl.v1 import (common_pb2, env_pb2_grpc, reference_pb2_grpc, reward_pb2_grpc, rollout_pb2_grpc,
                           trainer_pb2_grpc)

    stubs = {"trainer": trainer_pb2_grpc.TrainerStub, "rollout": rollout_pb2_grpc.RolloutStub,
             "reward": reward_pb2_grpc.RewardStub, "reference": reference_pb2_grpc.ReferenceStub,
             "env": env_pb2_grpc.EnvStub}
    out: dict[str, list[dict]] = {}
    for role, addrs in addresses.items():
        if role not in stubs:
            continue
        for addr in addrs:
            try:
                with grpc.insecure_channel(addr) as channel:
                    info = stubs[role](channel).GetInfo(common_pb2.GetInfoRequest(), timeout=timeout)
                out.setdefault(role, []).append({"address": addr, "model": info.model,
                                                 "details": parse_details(dict(info.details))})
            except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                out.setdefault(role, []).append({"address": addr, "error": f"{type(e).__name__}: {e}"[:500]})
    return out


def merge_infos(old: dict[str, list[dict]], new: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """The newer GetInfo answer of each replica, the older one where the newer failed (the mesh going down)."""
    out = {}
    for role in sorted(set(old) | set(new)):
        by_addr = {r["address"]: r for r in old.get(role, [])}
        for r in new.get(role, []):
            if "error" not in r or r["address"] not in by_addr:
                by_addr[r["address"]] = r
        out[role] = list(by_addr.values())
    return out
