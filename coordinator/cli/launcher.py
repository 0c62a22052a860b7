"""`meshrl up`: every service as its own process on 127.0.0.1, then one run driven to the end, with the replicas
supervised (a dead one is restarted on its port while the coordinator's pools fail over)."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from services.common.roles import PACKAGES

# The module each role runs as (`python -m`); a copy, since bench/e2e_grpo.py swaps one for a timed wrapper.
MODULES = dict(PACKAGES)
# Roles whose replicas the coordinator's pools (and, for env, the rollout replicas' env pool) fail over between: one
# that dies is restarted, the run goes on.
REPLICATED = ("rollout", "reward", "reference", "env")


# A CUDA_VISIBLE_DEVICES entry: an index, or a GPU / MIG UUID as nvidia-smi -L prints it.
_DEVICE_ENTRY = re.compile(r"[0-9]+|(?:GPU|MIG)-[0-9A-Za-z/-]+")


def replica_devices(devices: str, replicas: int, section: str) -> list[str]:
    """Each replica's CUDA_VISIBLE_DEVICES for `<section>.devices` spread over `<section>.replicas`.

    "" -> every replica inherits; one GPU -> every replica shares it; N GPUs -> contiguous blocks of
    N // replicas (one replica sees all N, e.g. a tensor-parallel engine); anything else is a ValueError.
    """
    if not devices.strip():
        return [""] * replicas
    ids = [d.strip() for d in devices.split(",")]
    for d in ids:
        if not _DEVICE_ENTRY.fullmatch(d):
            what = "an empty entry" if not d else f"entry {d!r}"
            raise ValueError(f"{section}.devices: {what} in \"{devices}\"; expected GPU indices or UUIDs "
                             f"separated by commas, e.g. \"4,5\"")
    seen = [str(int(d)) if d.isdigit() else d for d in ids]  # "04" and "4" are one GPU
    dup = next((d for i, d in enumerate(seen) if d in seen[:i]), None)
    if dup is not None:
        raise ValueError(f"{section}.devices: GPU {dup} is listed twice in \"{devices}\"")
    if len(ids) == 1:
        return [ids[0]] * replicas
    if replicas == 0:
        return []
    if len(ids) % replicas:
        raise ValueError(f"{section}.devices: {len(ids)} GPUs (\"{devices}\") do not split evenly over {replicas} "
                         f"replicas; list one GPU (shared), or a multiple of {section}.replicas")
    k = len(ids) // replicas
    return [",".join(ids[i * k:(i + 1) * k]) for i in range(replicas)]


def _die_with_parent(cmd: list[str]) -> list[str]:
    """Prefixes cmd so the kernel SIGTERMs the child if the launcher dies, even by kill -9.

    setpriv sets PR_SET_PDEATHSIG and execs; no Python runs between fork and exec (a preexec_fn
    there can abort in a process whose gRPC threads hold locks). The signal follows the thread that
    forked, so it is only asked for from the main thread, which lives as long as the launcher.
    """
    if threading.current_thread() is threading.main_thread() and shutil.which("setpriv"):
        return ["setpriv", "--pdeathsig", "TERM", "--", *cmd]
    return cmd


@dataclass
class Child:
    """A service process and the address it announced."""

    role: str
    index: int
    proc: subprocess.Popen
    log_path: Path
    address: str = ""
    devices: str = ""
    # The arguments it was started with beyond the recipe's (a replica's own --config), kept for restart().
    extra_args: list[str] = field(default_factory=list)
    _lines: queue.Queue = field(default_factory=queue.Queue)


class Launcher:
    """Starts service processes, learns their ports from the announce line, and stops them all."""

    def __init__(self, config_path: str, *, log_dir: Path, overrides: dict[str, str] | None = None,
                 host: str = "127.0.0.1", num_threads: int = 1):
        self.config_path = config_path
        self.log_dir = log_dir
        self.overrides = overrides or {}
        self.host = host
        self.num_threads = num_threads
        self.children: list[Child] = []
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, role: str, index: int = 0, *, devices: str = "", nproc: int = 1,
              extra_args: list[str] | None = None, log_name: str = "") -> Child:
        module = MODULES[role]
        args = ["-m", module, "--config", self.config_path, "--port", "0", "--host", self.host]
        for key, value in self.overrides.items():    # a list or mapping as YAML's inline form (JSON is one)
            args += [f"--{key}", value if isinstance(value, str) else json.dumps(value)]
        args += extra_args or []
        if role == "trainer" and nproc > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone", *args]
        else:
            cmd = [sys.executable, *args]
        env = dict(os.environ, OMP_NUM_THREADS=str(self.num_threads), PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1",
                   TOKENIZERS_PARALLELISM="false")
        if devices:
            env["CUDA_VISIBLE_DEVICES"] = devices
        log_path = self.log_dir / (log_name or f"{role}-{index}.log")
        # A session of its own: a terminal's Ctrl-C (SIGINT to the foreground process group) reaches the launcher
        # only, which lets the run's step in flight finish before it stops the services (coordinator/cli/interrupt.py).
        proc = subprocess.Popen(_die_with_parent(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, start_new_session=True)
        child = Child(role, index, proc, log_path, devices=devices, extra_args=list(extra_args or []))
        threading.Thread(target=self._pump, args=(child,), daemon=True).start()
        self.children.append(child)
        return child

    @staticmethod
    def _pump(child: Child) -> None:
        """Copies the child's output to its log file and hands lines to wait_ready."""
        with child.log_path.open("w") as f:
            for line in child.proc.stdout:
                f.write(line)
                f.flush()
                if not child.address:
                    child._lines.put(line)
        child._lines.put(None)

    def wait_ready(self, child: Child, timeout: float = 180.0) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                line = child._lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                child.proc.wait()
                raise ServiceFailed(failure(child, "before serving"))
            if _announced(child, line):
                return child.address
        raise ServiceFailed(f"{child.role}-{child.index} did not announce an address within {timeout}s "
                            f"(log: {child.log_path})")

    @staticmethod
    def poll_ready(child: Child) -> bool:
        """wait_ready without waiting: whether the child has announced its address by now."""
        while not child.address:
            try:
                line = child._lines.get_nowait()
            except queue.Empty:
                return False
            if line is None or _announced(child, line):
                return bool(child.address)
        return True

    def restart(self, child: Child, attempt: int, port: int) -> Child:
        """The same replica again on `port` (the coordinator's server list names it), logging to its own file."""
        return self.start(child.role, child.index, devices=child.devices,
                          extra_args=[*child.extra_args, "--port", str(port)],
                          log_name=f"{child.role}-{child.index}.restart-{attempt}.log")

    def stop_all(self, grace: float = 10.0) -> None:
        """SIGTERM every child (they drain), then SIGKILL what is left after `grace` seconds."""
        for c in self.children:
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.time() + grace
        for c in self.children:
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()

    def __enter__(self):
        # SIGTERM (a scheduler's stop, `timeout`, `kill`) unwinds like Ctrl-C, so the children are stopped here:
        # Python's default would end this process at once, and without setpriv (not on every image) nothing else
        # stops them; an orphaned trainer keeps its GPU memory.
        self._old_sigterm = None
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        return self

    def __exit__(self, *exc):
        try:
            self.stop_all()
        finally:
            if self._old_sigterm is not None:
                signal.signal(signal.SIGTERM, self._old_sigterm)


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def _announced(child: Child, line: str) -> bool:
    marker = f"meshrl {child.role} listening on "
    if marker in line:
        child.address = line.split(marker, 1)[1].strip()
    return bool(child.address)


class ServiceFailed(RuntimeError):
    """A service process exited or never announced its address; the message is one line with the cause."""


# A Python exception line ("ValueError: actor.model_path: ...", "torch.OutOfMemoryError: ..."), as a service
# prints it, or as torchrun's ranks print it ("[rank0]: ...").
_ERROR_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit)(?::\s.*)?)$")
# torchrun's report that a rank failed: the rank's own error line above it is the cause.
_LAUNCHER_ERRORS = ("ChildFailedError", "SignalException")


def cause_line(path: Path, *, last_line: bool = True) -> str:
    """The last error line a service's log names, skipping torchrun's own; else the last line (or "" when not
    `last_line`)."""
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    for line in reversed(lines):
        m = _ERROR_LINE.match(line)
        if m and not any(name in line for name in _LAUNCHER_ERRORS):
            return m.group(1)
    return lines[-1] if lines and last_line else ""


def failure(child: Child, when: str) -> str:
    """One line: which service exited, when, with what code, its cause line and where its log is."""
    code = child.proc.returncode
    # A process killed by a signal printed no cause: its last log line would be any line, so the signal is named.
    cause = cause_line(child.log_path, last_line=code is None or code >= 0)
    if not cause and code is not None and code < 0:
        cause = f"killed by {signal.Signals(-code).name}" if -code in signal.valid_signals() else "killed"
    return (f"{child.role}-{child.index} exited with code {child.proc.returncode} {when}"
            + (f": {cause}" if cause else "") + f" (log: {child.log_path})")


def torchrun_available() -> bool:
    return shutil.which("torchrun") is not None
