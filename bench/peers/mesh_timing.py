"""A meshrl service process with timers around its RPC handlers and engine calls: for bench/e2e_grpo.py.

`python -m bench.peers.mesh_timing --config FILE --port 0 ...` with MESHRL_BENCH_ROLE set runs the same
`main` as `python -m services.<role>` (or `coordinator`), after wrapping, as a timer, every call that
matters to the mesh-overhead estimate. Each finished call appends one JSON line to
$MESHRL_BENCH_TIMING_DIR/<role>-<pid>.jsonl:

- services: {"side": "server", "rpc", "start", "end", "handler_s", "compute_s", "convert_s"}: handler_s is the
  servicer method (protobuf -> dataclasses -> engine -> protobuf), compute_s the engine work inside it,
  convert_s its protobuf <-> Python conversions;
- coordinator: {"side": "client", "call", "target", "start", "end", "seconds"} per typed call of
  coordinator/training/remote.py (request built, RPC, response parsed), and {"side": "step", "step", "start", "end"}.

Timers are perf_counter pairs and one buffered line per call; the services are otherwise unchanged.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import os
import threading
import time

import gc

ROLE = os.environ.get("MESHRL_BENCH_ROLE", "")
# Seconds this process spent in the garbage collector (every generation; full collections counted apart):
# records carry the part that fell inside their span as gc_s.
_gc = {"s": 0.0, "full_s": 0.0, "t0": 0.0}


def _gc_timer(phase: str, info: dict) -> None:
    if phase == "start":
        _gc["t0"] = time.perf_counter()
        return
    seconds = time.perf_counter() - _gc["t0"]
    _gc["s"] += seconds
    if info.get("generation") == 2:
        _gc["full_s"] += seconds


gc.callbacks.append(_gc_timer)
_current: contextvars.ContextVar[dict | None] = contextvars.ContextVar("meshrl_bench_rpc", default=None)
_lock = threading.Lock()
_file = None


def _write(record: dict) -> None:
    global _file
    with _lock:
        if _file is None:
            folder = os.environ["MESHRL_BENCH_TIMING_DIR"]
            os.makedirs(folder, exist_ok=True)
            _file = open(os.path.join(folder, f"{ROLE}-{os.getpid()}.jsonl"), "a", buffering=1)
        _file.write(json.dumps(record) + "\n")


def _handler(cls, name: str) -> None:
    """Times a servicer method; engine timers inside it add to the record through a context variable
    (asyncio tasks and to_thread copy the context, so work done in a worker thread still finds it)."""
    orig = getattr(cls, name)

    @functools.wraps(orig)
    async def timed(self, request, context):
        rec = {"side": "server", "role": ROLE, "rpc": name, "start": time.time(), "compute_s": 0.0}
        token = _current.set(rec)
        t0, gc0, full0 = time.perf_counter(), _gc["s"], _gc["full_s"]
        try:
            return await orig(self, request, context)
        finally:
            rec["handler_s"] = time.perf_counter() - t0
            rec["gc_s"], rec["gc_full_s"] = _gc["s"] - gc0, _gc["full_s"] - full0
            rec["end"] = time.time()
            _current.reset(token)
            _write(rec)

    setattr(cls, name, timed)


def _add(seconds: float, key: str) -> None:
    rec = _current.get()
    if rec is not None:
        rec[key] = rec.get(key, 0.0) + seconds


def _compute(owner, name: str, key: str = "compute_s") -> None:
    """Times an engine method (sync or async) and adds its seconds to the enclosing handler's record."""
    orig = getattr(owner, name)
    if asyncio.iscoroutinefunction(orig):
        @functools.wraps(orig)
        async def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return await orig(*args, **kwargs)
            finally:
                _add(time.perf_counter() - t0, key)
    else:
        @functools.wraps(orig)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                _add(time.perf_counter() - t0, key)
    setattr(owner, name, timed)


def _converts(module, *names: str) -> None:
    """Times protobuf <-> Python conversions called by a handler (convert_s; part of handler_s - compute_s)."""
    for name in names:
        _compute(module, name, "convert_s")


def instrument_rollout():
    from services.rollout import servicer
    from services.rollout.engine_torch import engine as torch_engine

    for rpc in ("Generate", "ComputeLogProbs", "UpdateWeights"):
        _handler(servicer.RolloutServicer, rpc)
    # The decode of a batch (in the engine's worker thread) and the weight swap; receiving the buckets
    # (CRC, copy into the staging buffer) is transport.
    _compute(torch_engine.TorchEngine, "_generate_jobs")
    _compute(torch_engine, "swap_in")
    from bench.peers import long_tail
    long_tail.install()                 # e2e_grpo.py --lengths longtail: each sample stops at a drawn length
    from services.rollout import convert
    _converts(convert, "request_from_pb", "results_to_pb")
    from services.rollout.__main__ import main
    return main


def instrument_reward():
    from services.reward import engine, servicer

    _handler(servicer.RewardServicer, "Score")
    _compute(engine.RewardEngine, "score")
    from services.reward import convert
    _converts(convert, "items_from_pb", "results_to_pb")
    from services.reward.__main__ import main
    return main


def instrument_reference():
    from services.reference import engine, servicer

    _handler(servicer.ReferenceServicer, "ComputeLogProbs")
    _compute(engine.ReferenceEngine, "logprobs")
    from services.common import convert
    _converts(convert, "sequences_from_pb", "logprobs_to_pb")
    from services.reference.__main__ import main
    return main


def instrument_trainer():
    from services.trainer import engine, servicer

    for rpc in ("ComputeLogProbs", "TrainActor", "PushWeights"):
        _handler(servicer.TrainerServicer, rpc)
    # TrainActor's handler calls train_actor_step (train_actor is a wrapper over it that the handler never calls:
    # timing that one left the train phase's engine seconds at 0 from #21 on, and the whole train phase counted as
    # mesh overhead).
    for name in ("compute_logprobs", "train_actor_step"):
        _compute(engine.TrainerEngine, name)
    # PushWeights: gathering/casting the state is the trainer's work; the push to replicas is transport.
    _compute(engine.TrainerEngine, "state_for_sync")
    from services.common import convert as common_convert
    from services.trainer import convert
    _converts(convert, "train_actor_from_pb", "train_response_to_pb")
    _converts(common_convert, "sequences_from_pb", "logprobs_to_pb")
    from services.trainer.__main__ import main
    return main


def _client_call(module, name: str) -> None:
    orig = getattr(module, name)

    @functools.wraps(orig)
    async def timed(stub, *args, **kwargs):
        from coordinator.training.context import GuardedTrainer

        start, t0, gc0 = time.time(), time.perf_counter(), _gc["s"]
        try:
            return await orig(stub, *args, **kwargs)
        finally:
            target = "trainer" if isinstance(stub, GuardedTrainer) else type(stub).__name__.removesuffix("Stub").lower()
            _write({"side": "client", "call": name, "target": target, "start": start, "end": time.time(),
                    "seconds": time.perf_counter() - t0, "gc_s": _gc["s"] - gc0})

    setattr(module, name, timed)


def instrument_coordinator():
    import dataclasses

    from coordinator.training import remote
    from coordinator.training.algorithms import ALGORITHMS

    for name in ("generate", "score", "logprobs", "train_actor", "push_weights"):
        _client_call(remote, name)
    orig = ALGORITHMS["rl"].step

    @functools.wraps(orig)
    async def rl_step(ctx):
        start, gc0, full0 = time.time(), _gc["s"], _gc["full_s"]
        try:
            return await orig(ctx)
        finally:
            _write({"side": "step", "step": ctx.step, "start": start, "end": time.time(), "gc_s": _gc["s"] - gc0,
                    "gc_full_s": _gc["full_s"] - full0})

    ALGORITHMS["rl"] = dataclasses.replace(ALGORITHMS["rl"], step=rl_step)
    from coordinator.__main__ import main
    return main


ROLES = {"rollout": instrument_rollout, "reward": instrument_reward, "reference": instrument_reference,
         "trainer": instrument_trainer, "coordinator": instrument_coordinator}

if __name__ == "__main__":
    if ROLE not in ROLES:
        raise SystemExit(f"MESHRL_BENCH_ROLE: expected one of {', '.join(ROLES)}, got {ROLE!r}")
    ROLES[ROLE]()()
