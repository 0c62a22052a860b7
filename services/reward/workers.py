"""User reward functions as components: worker processes with a per-call timeout, replaced after a failure.

Each worker is a spawned process holding one end of a pipe: it receives a chunk of samples and sends
back one result per sample as it goes, so the parent can time every single call. A call that runs
past `reward.function_timeout_s` gets its worker killed (SIGKILL; a hung C extension ignores anything gentler); a
worker that dies (segfault, `os._exit`, the OOM killer) is noticed by the closed pipe. Either way
only the call that was using that worker fails, and a fresh worker takes its place for the next one. A
function that raises or returns no usable score fails only that sample (a failed `Value` naming it); the
worker goes on with the next.

Why not concurrent.futures.ProcessPoolExecutor: on Python < 3.14 it cannot kill a hung worker, and
one crashed worker breaks the whole executor, failing every call in flight rather than the guilty one.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import multiprocessing as mp
import queue
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Sequence

from services.common.errors import DeadlineExceeded, FailedPrecondition, MeshError
from services.reward.plugins import load_function
from services.reward.types import Value

if TYPE_CHECKING:  # annotations only: a spawned worker imports this module and need not load pydantic
    from services.reward.config import ComponentConfig
    from services.reward.types import ScoreItem

log = logging.getLogger("meshrl.reward")

# A fresh worker imports the user's module before its first call; that may take a while (torch).
STARTUP_TIMEOUT_S = 120.0


class RewardFunctionError(MeshError):
    """A user reward function killed its worker process (a segfault, `os._exit`, the OOM killer)."""

    status = "INTERNAL"


def result_value(value: Any) -> tuple[float, dict[str, float]]:
    """A user function's return as (score, extra numeric keys): a number, or a dict with `score` (verl) whose
    other numeric keys are extras (non-numeric ones are left out). ValueError says what is wrong with it."""
    extras: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"returned a dict without 'score' (keys: {', '.join(map(str, value)) or 'none'})")
        for k, v in value.items():
            if k != "score" and isinstance(v, (int, float)) and math.isfinite(v):
                extras[str(k)] = float(v)
        value = value["score"]
    if isinstance(value, (str, bytes)):
        raise ValueError(f"returned {type(value).__name__} {value!r:.80}, not a number")
    try:
        score = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"returned {type(value).__name__} {value!r:.80}, not a number") from None
    if not math.isfinite(score):
        raise ValueError(f"returned {score}, not a finite number")
    return score, extras


def _worker_main(conn, path: str, params: dict, call: str = "meshrl") -> None:
    """Body of a worker process: load the function, then score chunks until the pipe closes. A sample the
    function fails on (raises, NaN, no score) is answered as failed and the chunk goes on."""
    import signal

    # Ctrl-C reaches the whole process group; the service decides when workers stop (it kills them,
    # or they see the pipe close when it exits), so a worker does not die mid-call with a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    try:
        fn = load_function(path, params=list(params), call=call)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the call
        conn.send(("fatal", f"{type(e).__name__}: {e}"))
        return
    loop = asyncio.new_event_loop()         # for async functions; one per worker
    conn.send(("ready",))
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):  # the service went away
            return
        for kwargs in chunk:
            try:
                value = fn(**kwargs, **params)
                if inspect.isawaitable(value):
                    value = loop.run_until_complete(value)
            except BaseException as e:  # noqa: BLE001 - SystemExit, KeyboardInterrupt too: the sample fails
                conn.send(("failed", f"raised {type(e).__name__}: {e}", traceback.format_exc()))
                continue
            try:
                conn.send(("ok", *result_value(value)))
            except ValueError as e:
                conn.send(("failed", str(e), ""))


class _Failure(Exception):
    """A chunk failed at sample `index` of the chunk; `kind` is timeout, crash or startup."""

    def __init__(self, kind: str, index: int, message: str, detail: str = ""):
        super().__init__(message)
        self.kind, self.index, self.message, self.detail = kind, index, message, detail


class _Worker:
    """One worker process and the parent's end of its pipe. Used by one thread at a time."""

    def __init__(self, ctx, path: str, params: dict, call: str):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, path, params, call), daemon=True,
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

    def run(self, chunk: Sequence[dict], timeout_s: float) -> list[tuple]:
        """One (score, extras) or ("failed", message, traceback) per sample of the chunk."""
        if not self.ready:
            self._wait_ready()
        try:
            self.conn.send(list(chunk))
        except (BrokenPipeError, EOFError, OSError):
            raise _Failure("crash", 0, f"worker process died (exit code {self._reap()})") from None
        values: list[tuple] = []
        for i in range(len(chunk)):
            if not self.conn.poll(timeout_s):
                self.kill()
                raise _Failure("timeout", i, f"took longer than reward.function_timeout_s={timeout_s:g} s")
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                raise _Failure("crash", i, f"killed its worker process (exit code {self._reap()})") from None
            values.append(msg[1:] if msg[0] == "ok" else msg)
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

    def __init__(self, path: str, params: dict[str, Any], *, num_workers: int, timeout_s: float,
                 call: str = "meshrl"):
        self.path, self.params, self.timeout_s, self.num_workers = path, dict(params), timeout_s, num_workers
        self.call = call
        # spawn, not fork: the service process has grpc and torch threads, which fork does not survive.
        self._ctx = mp.get_context("spawn")
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        for _ in range(num_workers):
            self._idle.put(_Worker(self._ctx, path, self.params, call))
        # One thread per worker waits on its pipe; chunks beyond that queue in the executor.
        self._threads = ThreadPoolExecutor(num_workers, thread_name_prefix="reward-fn")
        self._closed = False
        self.num_replaced = 0

    def _run_chunk(self, chunk: Sequence[dict]) -> list[tuple]:
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
        return _Worker(self._ctx, self.path, self.params, self.call)

    async def score(self, samples: Sequence[dict], *, names: Sequence[str]) -> list[Value]:
        """The function's value on every sample, in order; a sample it fails on (raises, returns NaN or no
        score) is a failed Value naming the function and the sample; a hang or a crash fails the call."""
        if self._closed:
            raise RuntimeError("reward worker pool is closed")
        n = len(samples)
        num_chunks = max(1, min(self.num_workers, n))
        bounds = [(n * k // num_chunks, n * (k + 1) // num_chunks) for k in range(num_chunks)]
        loop = asyncio.get_running_loop()

        async def run(start: int, end: int) -> list[tuple]:
            try:
                return await loop.run_in_executor(self._threads, self._run_chunk, samples[start:end])
            except _Failure as f:
                raise self._error(f, names[start + f.index]) from None

        parts = await asyncio.gather(*(run(a, b) for a, b in bounds))
        return [self._value(r, where) for r, where in zip((r for part in parts for r in part), names)]

    def _value(self, result: tuple, where: str) -> Value:
        if result[0] != "failed":
            return Value(float(result[0]), dict(result[1]))
        message = f"reward function {self.path} {result[1]} on {where}"
        log.error("%s%s", message, "\n" + result[2] if result[2] else "")
        return Value(math.nan, {}, message)

    def _error(self, f: _Failure, where: str) -> MeshError:
        if f.kind == "startup":
            return FailedPrecondition(f"reward function {self.path}: {f.message}")
        message = f"reward function {self.path} {f.message} on {where}"
        if f.kind == "timeout":
            return DeadlineExceeded(message + "; its worker was killed and replaced")
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
        self.key, self.weight, self.path, self.call = config.key, config.weight, config.function, config.call
        self.params = dict(config.params)
        # Import and check here, in the service process, so a broken function fails at start.
        load_function(self.path, params=list(self.params), call=self.call)
        self.pool = WorkerPool(self.path, self.params, num_workers=num_workers, timeout_s=timeout_s, call=self.call)
        log.info("user reward function %s (%s keywords): %d worker processes, %.3g s per call", self.path, self.call,
                 num_workers, timeout_s)

    async def score(self, items: Sequence[ScoreItem]) -> list[Value]:
        kwargs = [it.verl_kwargs() if self.call == "verl" else it.kwargs() for it in items]
        return await self.pool.score(kwargs, names=[it.where for it in items])

    def describe(self) -> str:
        return f"function={self.path} call={self.call}" + "".join(f" {k}={v!r}" for k, v in self.params.items())

    async def close(self) -> None:
        self.pool.close()

    def close_now(self) -> None:
        self.pool.close()
