"""Concurrent reference log-prob calls on a LoRA trainer share one command (services/trainer/coalesce.py): each caller
gets its own rows at its own temperature, a merged command stays within actor.max_batch_size rows, a bad request fails
alone, a failed command fails every call in it, and a caller that gives up leaves the others answered.

Merged rows are compared with allclose at float32, not bitwise: the command groups the merged rows into other
micro-batches (other padded widths) than a call alone, and those shapes change the kernels' reduction order (about
1e-5 apart on CPU), as a call's rows already do with whatever else is in its request."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import grpc
import pytest
import torch

from meshrl.v1 import common_pb2, reference_pb2_grpc, trainer_pb2_grpc
from services.common.config import load_config
from services.common.rpc.channel import create_channel
from services.trainer import commands
from services.trainer.config import TrainerSettings
from services.trainer.engine import TrainerEngine

LORA = {"rank": 4, "alpha": 8}


def _engine(model_path: str, **actor) -> TrainerEngine:
    return TrainerEngine(load_config(TrainerSettings, data={"model": {"path": model_path},
                                                            "actor": {"lr": 1e-2, "lora": LORA, **actor}}))


def _requests(sizes_and_temperatures, seed: int = 0):
    """(prompts, responses, temperature) per request: rows of random lengths over the arith vocabulary."""
    rng = random.Random(seed)
    return [([[rng.randrange(3, 44) for _ in range(rng.randint(1, 12))] for _ in range(n)],
             [[rng.randrange(3, 44) for _ in range(rng.randint(1, 20))] for _ in range(n)], t)
            for n, t in sizes_and_temperatures]


def _held(engine: TrainerEngine, coalescer, calls) -> list:
    """Runs each call in its own thread while the trainer is busy (its command lock held here) and lets the trainer
    go once all of them queued: they meet as several runs' calls meet behind another run's step. -> each call's
    result, or the error it raised."""
    out: list = [None] * len(calls)

    def call(i):
        try:
            out[i] = calls[i]()
        except Exception as e:          # noqa: BLE001 - returned to the test
            out[i] = e

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(calls))]
    with engine.commands._lock:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while coalescer.queued() < len(calls):
            assert time.monotonic() < deadline, f"{coalescer.queued()} of {len(calls)} calls queued"
            time.sleep(0.01)
    for t in threads:
        t.join(30)
    return out


def _close(got, want) -> None:
    assert [len(r) for r in got] == [len(r) for r in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.tensor(g), torch.tensor(w), rtol=1.3e-6, atol=1e-5)


def _spy(monkeypatch, fail: bool = False, name: str = "compute_logprobs") -> list[int]:
    """Records the rows of each `name` command (or fails it)."""
    sizes: list[int] = []
    real = commands.COMMANDS[name]

    def spied(rank, prompts, *args):
        sizes.append(len(prompts))
        if fail:
            raise RuntimeError("the device fell over")
        return real(rank, prompts, *args)

    monkeypatch.setitem(commands.COMMANDS, name, spied)
    return sizes


def test_concurrent_reference_calls_share_one_command_per_temperature_and_each_gets_its_own_rows(
        arith_model_path, monkeypatch):
    e = _engine(arith_model_path)
    reqs = _requests([(3, 1.0), (5, 0.7), (1, 1.0), (4, 1.0), (2, 0.7)])
    alone = [e.compute_reference_logprobs(*r) for r in reqs]
    sizes = _spy(monkeypatch)
    got = _held(e, e.reference, [lambda r=r: e.compute_reference_logprobs(*r) for r in reqs])
    # One command per temperature, never two temperatures in one.
    assert sorted(sizes) == [7, 8]
    for g, want in zip(got, alone):
        _close(g, want)
    info = e.info()
    assert (info["reference_calls"], info["reference_commands"], info["reference_merged_calls"]) == (10, 7, 5)
    # The run's own adapter ("") merges the same way (the same weights for every call of a command).
    reqs = _requests([(2, 1.0), (3, 1.0), (1, 1.0)], seed=1)
    sizes = _spy(monkeypatch, name="adapter_logprobs")
    alone = [e.compute_logprobs(*r) for r in reqs]
    got = _held(e, e.actor_logprobs, [lambda r=r: e.compute_logprobs(*r) for r in reqs])
    for g, want in zip(got, alone):
        _close(g, want)
    assert sizes[-4:] == [2, 3, 1, 6] and e.info()["logprobs_merged_calls"] == 3


def test_a_merged_command_stays_within_max_batch_size_rows(arith_model_path, monkeypatch):
    e = _engine(arith_model_path, max_batch_size=6)
    reqs = _requests([(4, 1.0), (4, 1.0), (2, 1.0), (3, 1.0), (1, 1.0)], seed=2)
    alone = [e.compute_reference_logprobs(*r) for r in reqs]
    sizes = _spy(monkeypatch)
    got = _held(e, e.reference, [lambda r=r: e.compute_reference_logprobs(*r) for r in reqs])
    # 14 rows need 3 commands of <= 6; first fit in arrival order may leave a 4th.
    assert sum(sizes) == 14 and max(sizes) <= 6 and 3 <= len(sizes) <= 4, sizes
    for g, want in zip(got, alone):
        _close(g, want)


def test_a_bad_request_fails_alone_and_a_failed_command_fails_every_call_in_it(arith_model_path, monkeypatch):
    e = _engine(arith_model_path)
    reqs = _requests([(2, 1.0), (3, 1.0)], seed=3)
    alone = [e.compute_reference_logprobs(*r) for r in reqs]
    bad = ([[5, 6]], [[7, 99]], 1.0)           # token 99 is past the vocabulary (44)
    with e.commands._lock:                     # checked before it queues: refused while the trainer is busy
        with pytest.raises(ValueError, match="99"):
            e.compute_reference_logprobs(*bad)
    got = _held(e, e.reference, [lambda r=r: e.compute_reference_logprobs(*r) for r in reqs])
    for g, want in zip(got, alone):
        _close(g, want)
    _spy(monkeypatch, fail=True)
    got = _held(e, e.reference, [lambda r=r: e.compute_reference_logprobs(*r) for r in reqs])
    assert all(isinstance(g, RuntimeError) and "fell over" in str(g) for g in got), got
    monkeypatch.undo()
    _close(e.compute_reference_logprobs(*reqs[0]), alone[0])      # the next call runs as before


def _pb(prompts, responses, temperature) -> common_pb2.LogProbsRequest:
    return common_pb2.LogProbsRequest(sequences=[
        common_pb2.TokenSequence(id=f"s{i}", prompt_ids=p, response_ids=r)
        for i, (p, r) in enumerate(zip(prompts, responses))], temperature=temperature)


def test_a_caller_past_its_deadline_leaves_the_calls_merged_with_it_answered(arith_model_path):
    from services.trainer.servicer import start

    reqs = _requests([(2, 1.0), (3, 1.0), (2, 1.0)], seed=4)

    async def main():
        settings = load_config(TrainerSettings, data={"model": {"path": arith_model_path},
                                                       "actor": {"lr": 1e-2, "lora": LORA}})
        mesh, port, e = await start(settings, "127.0.0.1:0")
        alone = [await asyncio.to_thread(e.compute_reference_logprobs, *r) for r in reqs]
        try:
            async with create_channel(f"127.0.0.1:{port}") as channel:
                stub = reference_pb2_grpc.ReferenceStub(channel)
                e.commands._lock.acquire()                  # the trainer is busy: the calls queue
                try:
                    calls = [asyncio.ensure_future(stub.ComputeLogProbs(_pb(*r), timeout=1.0 if i == 1 else 60))
                             for i, r in enumerate(reqs)]
                    while e.reference.queued() < len(reqs):
                        await asyncio.sleep(0.01)
                    with pytest.raises(grpc.aio.AioRpcError) as gone:
                        await calls[1]
                    assert gone.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                finally:
                    e.commands._lock.release()
                got = [[list(x.logprobs) for x in (await calls[i]).results] for i in (0, 2)]
                info = await trainer_pb2_grpc.TrainerStub(channel).GetInfo(common_pb2.GetInfoRequest())
                return alone, got, info.details
        finally:
            await mesh.stop(0)
            e.close()

    alone, got, details = asyncio.run(main())
    for g, want in zip(got, [alone[0], alone[2]]):
        _close(g, want)
    assert details["reference_merged_calls"] == "3" and details["reference_commands"] == "4"
