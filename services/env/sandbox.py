"""The `python` tool: runs model-written code in a fresh sandboxed process per call (services/env/sandbox_child.py).

What it guarantees (docs/agentic.md): CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS), file size and the
number of processes are limited (RLIMIT_NPROC; as root a pids cgroup, or a seccomp filter allowing no new
process); stdout past `max_output_bytes` kills the process, of stderr the last `max_output_bytes` are kept; at
`timeout_s` the whole process group is killed, and with namespaces every process the code started (the PID
namespace dies with its first process). Network: a fresh network namespace (no route anywhere) when the kernel
allows one, with a mount namespace whose every mount is read-only but the call's working directory; otherwise Python's socket module is disabled in the process, which code calling libc directly can
get around, and the filesystem is not isolated; `env.python.network: namespace` refuses to start without the namespace instead.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from services.env.config import PythonToolConfig
from services.env.types import ToolError

CHILD = str(Path(__file__).with_name("sandbox_child.py"))
EXIT_SETUP = 97


def _limits(cfg: PythonToolConfig, network: str, cgroup: str = "") -> str:
    return json.dumps({"cpu_s": cfg.cpu_s, "memory_bytes": cfg.memory_mb * 2**20, "processes": cfg.max_processes,
                       "file_bytes": cfg.max_file_mb * 2**20, "network": network, "cgroup": cgroup})


# Where a pids cgroup can be made per call: cgroup v1's pids hierarchy, or v2's unified one.
CGROUP_BASES = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup")


def _make_pids_cgroup(base: str, name: str, max_pids: int) -> str | None:
    path = os.path.join(base, name)
    try:
        os.mkdir(path)
    except OSError:
        return None
    try:
        with open(os.path.join(path, "pids.max"), "w") as f:
            f.write(str(max_pids))
        return path
    except OSError:
        _remove_cgroup(path)
        return None


def _remove_cgroup(path: str) -> None:
    for _ in range(50):   # its processes may take a moment to leave after the kill
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)


def probe_cgroup_base() -> str | None:
    """A cgroup folder where this process (root) may make pids cgroups, or None (RLIMIT_NPROC does not bind root,
    so the sandbox then forbids new processes with a seccomp filter)."""
    if os.geteuid() != 0:
        return None
    for base in CGROUP_BASES:
        path = _make_pids_cgroup(base, f"meshrl-probe-{os.getpid()}", 1)
        if path:
            _remove_cgroup(path)
            return base
    return None


def probe_namespaces() -> bool:
    """Whether this kernel gives the sandbox its network and PID namespaces (asked once, at start)."""
    code = ("import socket\ns = socket.socket()\ns.settimeout(1)\n"
            "try:\n    s.connect(('192.0.2.1', 9))\nexcept OSError as e:\n    print(e.errno)\n")
    try:
        out = subprocess.run([sys.executable, "-I", CHILD, _limits(PythonToolConfig(), "namespace")], input=code,
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and out.stdout.strip() == "101"   # ENETUNREACH: no route out of the namespace


class PythonTool:
    name = "python"

    def __init__(self, cfg: PythonToolConfig):
        self.cfg = cfg
        self.isolated = probe_namespaces()
        self.cgroup_base = probe_cgroup_base()
        if cfg.network == "namespace" and not self.isolated:
            raise ValueError("env.python.network: 'namespace' cannot be honoured: this kernel refuses network "
                             "namespaces to this user (run as root or allow unprivileged user namespaces, or set "
                             "network: auto)")

    def guarantees(self) -> str:
        net = "network namespace" if self.isolated else "socket module disabled (best effort)"
        if os.geteuid() != 0:
            procs = f"{self.cfg.max_processes} processes (RLIMIT_NPROC)"
        else:
            procs = (f"{self.cfg.max_processes} processes (pids cgroup)" if self.cgroup_base else
                     "no new processes (seccomp; root without a writable pids cgroup)")
        pid_ns = ", PID namespace, read-only filesystem but its working directory" if self.isolated else \
            ", filesystem not isolated"
        return (f"cpu {self.cfg.cpu_s}s, memory {self.cfg.memory_mb} MiB, output {self.cfg.max_output_bytes} B, "
                f"timeout {self.cfg.timeout_s:g}s, {procs}, {net}{pid_ns}")

    def schema(self) -> dict:
        return {"type": "function", "function": {
            "name": self.name,
            "description": "Runs Python 3 code in a fresh sandbox (no network) and returns what it prints; the "
                           "value of a last bare expression is printed too.",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}

    async def __call__(self, arguments: dict[str, Any], *, episode_id: str = "") -> str:
        code = arguments.get("code")
        if not isinstance(code, str) or set(arguments) != {"code"}:
            raise ToolError(f"arguments: python takes exactly {{'code': str}}, got keys {sorted(arguments)}")
        return await self.run(code)

    async def run(self, code: str) -> str:
        """Output of the code (stdout, then stderr when it failed); ToolError when it failed or hit a limit."""
        workdir = tempfile.mkdtemp(prefix="meshrl-python-")
        cgroup = None
        if self.cgroup_base:
            cgroup = _make_pids_cgroup(self.cgroup_base, os.path.basename(workdir), self.cfg.max_processes + 2)
            if cgroup is None:
                raise ToolError("sandbox could not start: cannot make its pids cgroup")
        try:
            return await self._run_in(code, workdir, cgroup or "")
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            if cgroup:
                await asyncio.to_thread(_remove_cgroup, cgroup)

    async def _run_in(self, code: str, workdir: str, cgroup: str) -> str:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", CHILD, _limits(self.cfg, "namespace" if self.isolated else "sockets", cgroup),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            cwd=workdir, start_new_session=True,
            env={"PATH": os.defpath, "HOME": workdir, "TMPDIR": workdir, "OMP_NUM_THREADS": "1",
                 "PYTHONIOENCODING": "utf-8"})
        bufs, over = (bytearray(), bytearray()), asyncio.Event()
        # stdout past the limit kills the process; of stderr the last max_output_bytes are kept (a traceback's end).
        readers = [asyncio.create_task(_read_capped(proc.stdout, bufs[0], self.cfg.max_output_bytes, over)),
                   asyncio.create_task(_read_tail(proc.stderr, bufs[1], self.cfg.max_output_bytes))]
        proc.stdin.write(code.encode())
        proc.stdin.close()
        finished = asyncio.create_task(_finished(proc, readers))
        overflow = asyncio.create_task(over.wait())
        killed = ""
        try:
            done, _ = await asyncio.wait({finished, overflow}, timeout=self.cfg.timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if overflow in done:
                killed = f"output past env.python.max_output_bytes ({self.cfg.max_output_bytes} bytes); killed"
            elif finished not in done:
                killed = f"timed out after {self.cfg.timeout_s:g}s (env.python.timeout_s); killed"
        finally:
            _kill_group(proc.pid)
            for task in (*readers, finished, overflow):
                task.cancel()
            await proc.wait()
        out = bytes(bufs[0][:self.cfg.max_output_bytes]).decode(errors="replace")
        err = bytes(bufs[1]).decode(errors="replace")
        return self._result(proc.returncode, out, err, killed)

    def _result(self, rc: int, out: str, err: str, killed: str) -> str:
        if killed:
            raise ToolError(f"{killed}\n{out[-2000:]}".rstrip())
        if rc == 0:
            return out
        if rc == 128 + signal.SIGXCPU or rc == 128 + signal.SIGKILL:
            raise ToolError(f"killed: CPU time limit of {self.cfg.cpu_s}s (env.python.cpu_s)\n{out[-2000:]}".rstrip())
        if rc == EXIT_SETUP:
            raise ToolError(f"sandbox could not start: {err.strip()}")
        if rc > 128:
            raise ToolError(f"killed by signal {rc - 128}\n{out}{err}".rstrip())
        raise ToolError(f"{out}{err}".strip() or f"exited with status {rc}")

    async def close(self) -> None:
        pass


async def _read_capped(stream: asyncio.StreamReader, into: bytearray, limit: int, over: asyncio.Event) -> None:
    """Reads a pipe into `into` until EOF, or until it holds more than `limit` bytes (then sets `over`)."""
    while chunk := await stream.read(65536):
        into += chunk
        if len(into) > limit:
            over.set()
            return


async def _read_tail(stream: asyncio.StreamReader, into: bytearray, limit: int) -> None:
    """Reads a pipe until EOF, keeping its last `limit` bytes in `into`."""
    while chunk := await stream.read(65536):
        into += chunk
        del into[:-limit]


async def _finished(proc: asyncio.subprocess.Process, readers: list[asyncio.Task]) -> None:
    """The process exited and both pipes reached EOF."""
    await asyncio.gather(proc.wait(), *readers)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
