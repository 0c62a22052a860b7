"""User reward functions as components: worker processes with a per-call timeout, replaced after a failure.

Each worker is a spawned process holding one end of a pipe: it receives a chunk of samples and sends
back one result per sample as it goes, so the parent can time every single call. A call that runs
past `reward.function_timeout_s` gets its worker killed (SIGKILL; a hung C extension ignores anything gentler); a
worker that dies (segfault, `os._exit`, the OOM killer) is noticed by the closed pipe. Either way
only the call that was using that worker fails, and a fresh worker takes its place for the next one.

Why not concurrent.futures.ProcessPoolExecutor: on Python < 3.14 it cannot kill a hung worker, and
one crashed worker breaks the whole executor, failing every call in flight rather than the guilty one.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import queue
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Sequence

from services.common.errors import DeadlineExceeded, FailedPrecondition, MeshError
from services.reward.plugins import load_function

if TYPE_CHECKING:  # annotations only: a spawned worker imports this module and need not load pydantic
    from services.reward.config import ComponentConfig
    from services.reward.types import ScoreItem

log = logging.getLogger("meshrl.reward")

# A fresh worker imports the user's module before its first call; that may take a while (torch).
STARTUP_TIMEOUT_S = 120.0


class RewardFunctionError(MeshError):
    """A user reward function raised, returned something that is not a number, or killed its worker."""

    status = "INTERNAL"


def _worker_main(conn, path: str, params: dict) -> None:
    """Body of a worker process: load the function, then score chunks until the pipe closes."""
    import signal

    # Ctrl-C reaches the whole process group; the service decides when workers stop (it kills them,
    # or they see the pipe close when it exits), so a worker does not die mid-call with a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    try:
        fn = load_function(path, params=list(params))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the call
        conn.send(("fatal", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready",))
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):  # the service went away
            return
        for kwargs in chunk:
            try:
                value = fn(**kwargs, **params)
            except BaseException as e:  # noqa: BLE001 - SystemExit, KeyboardInterrupt too: the call fails
                conn.send(("error", f"raised {type(e).__name__}: {e}", traceback.format_exc()))
                break
            try:
                if isinstance(value, (str, bytes)):
                    raise TypeError
                conn.send(("ok", float(value)))
            except (TypeError, ValueError):
                conn.send(("error", f"returned {type(value).__name__} {value!r:.80}, not a number", ""))
                break


class _Failure(Exception):
    """A chunk failed at sample `index` of the chunk; `kind` is timeout, crash, error or startup."""

    def __init__(self, kind: str, index: int, message: str, detail: str = ""):
        super().__init__(message)
        self.kind, self.index, self.message, self.detail = kind, index, message, detail


class _Worker:
    """One worker process and the parent's end of its pipe. Used by one thread at a time."""

    def __init__(self, ctx, path: str, params: dict):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, path, params), daemon=True,
                                name=f"reward-fn:{path}")
        self.proc.start()
        child.close()
        self.ready = False

    @property
    def alive(self) -> bool:
        return self.proc.is_alive()

    def _wait_ready(self) -> None:
        if not self.conn.poll(STARTUP_TIMEOUT_S):
            self.kill()
            raise _Failure("startup", 0, f"worker did not start within {STARTUP_TIMEOUT_S:g} s")
        try:
            msg = self.conn.recv()
        except (EOFError, OSError):
            raise _Failure("startup", 0, f"worker exited while starting (exit code {self._reap()})") from None
        if msg[0] == "fatal":
            raise _Failure("startup", 0, f"worker could not load it: {msg[1]}")
        self.ready = True

    def run(self, chunk: Sequence[dict], timeout_s: float) -> list[float]:
        if not self.ready:
            self._wait_ready()
        try:
            self.conn.send(list(chunk))
        except (BrokenPipeError, EOFError, OSError):
            raise _Failure("crash", 0, f"worker process died (exit code {self._reap()})") from None
        values: list[float] = []
        for i in range(len(chunk)):
            if not self.conn.poll(timeout_s):
                self.kill()
                raise _Failure("timeout", i, f"took longer than reward.function_timeout_s={timeout_s:g} s")
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                raise _Failure("crash", i, f"killed its worker process (exit code {self._reap()})") from None
            if msg[0] == "error":
                raise _Failure("error", i, msg[1], msg[2])
            values.append(msg[1])
        return values

    def _reap(self) -> int | None:
        self.proc.join(5)
        return self.proc.exitcode

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class WorkerPool:
    """`num_workers` worker processes for one user function; a batch is split into one chunk per worker."""

    def __init__(self, path: str, params: dict[str, Any], *, num_workers: int, timeout_s: float):
        self.path, self.params, self.timeout_s, self.num_workers = path, dict(params), timeout_s, num_workers
        # spawn, not fork: the service process has grpc and torch threads, which fork does not survive.
        self._ctx = mp.get_context("spawn")
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        for _ in range(num_workers):
            self._idle.put(_Worker(self._ctx, path, self.params))
        # One thread per worker waits on its pipe; chunks beyond that queue in the executor.
        self._threads = ThreadPoolExecutor(num_workers, thread_name_prefix="reward-fn")
        self._closed = False
        self.num_replaced = 0

    def _run_chunk(self, chunk: Sequence[dict]) -> list[float]:
        worker = self._idle.get()
        try:
            if not worker.alive:  # died while idle (OOM killer): not this call's fault
                worker = self._replace(worker)
            return worker.run(chunk, self.timeout_s)
        finally:
            if self._closed:
                worker.kill()
            else:
                self._idle.put(worker if worker.alive else self._replace(worker))

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        self.num_replaced += 1
        log.warning("reward function %s: worker process replaced (%d so far)", self.path, self.num_replaced)
        return _Worker(self._ctx, self.path, self.params)

    async def score(self, samples: Sequence[dict], *, names: Sequence[str]) -> list[float]:
        """The function's value on every sample, in order; raises naming the function and the sample."""
        if self._closed:
            raise RuntimeError("reward worker pool is closed")
        n = len(samples)
        num_chunks = max(1, min(self.num_workers, n))
        bounds = [(n * k // num_chunks, n * (k + 1) // num_chunks) for k in range(num_chunks)]
        loop = asyncio.get_running_loop()

        async def run(start: int, end: int) -> list[float]:
            try:
                return await loop.run_in_executor(self._threads, self._run_chunk, samples[start:end])
            except _Failure as f:
                raise self._error(f, names[start + f.index]) from None

        parts = await asyncio.gather(*(run(a, b) for a, b in bounds))
        return [v for part in parts for v in part]

    def _error(self, f: _Failure, where: str) -> MeshError:
        if f.kind == "startup":
            return FailedPrecondition(f"reward function {self.path}: {f.message}")
        message = f"reward function {self.path} {f.message} on {where}"
        if f.kind == "timeout":
            return DeadlineExceeded(message + "; its worker was killed and replaced")
        if f.kind == "error" and f.detail:
            log.error("%s\n%s", message, f.detail)
        if f.kind == "crash":
            message += "; a fresh worker replaces it"
        return RewardFunctionError(message)

    def close(self) -> None:
        """Kills the idle workers now; busy ones are killed when their chunk returns."""
        if self._closed:
            return
        self._closed = True
        self._threads.shutdown(wait=False, cancel_futures=True)
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                break


class UserFunctionComponent:
    """A reward component backed by a user function running in a pool of worker processes."""

    def __init__(self, config: ComponentConfig, *, timeout_s: float, num_workers: int):
        assert config.function is not None
        self.key, self.weight, self.path = config.key, config.weight, config.function
        self.params = dict(config.params)
        # Import and check here, in the service process, so a broken function fails at start.
        load_function(self.path, params=list(self.params))
        self.pool = WorkerPool(self.path, self.params, num_workers=num_workers, timeout_s=timeout_s)
        log.info("user reward function %s: %d worker processes, %.3g s per call", self.path, num_workers, timeout_s)

    async def score(self, items: Sequence[ScoreItem]) -> list[float]:
        return await self.pool.score([it.kwargs() for it in items], names=[it.where for it in items])

    def describe(self) -> str:
        return f"function={self.path}" + "".join(f" {k}={v!r}" for k, v in self.params.items())

    async def close(self) -> None:
        self.pool.close()

    def close_now(self) -> None:
        self.pool.close()
