"""Several training clients at once on one trainer (docs/training_api.md "Several clients"), on real servers: each
trains its own adapter over the one frozen base, their calls interleave from two threads without mixing
gradients (one's interleaved course equals the same course run alone, from the same saved start), and each
client's Sample pushes its adapter alone and samples under it (the sampler's log-probs are that client's). On a
replica whose engine serves no adapters, one client at a time samples, from its adapter merged into the base."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import threading

import grpc
import pytest

from services.common.config import load_config
from services.local import start_local_mesh
from services.training_api.client import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient
from services.training_api.config import TrainingSettings
from services.training_api.servicer import start as start_training
from tests.integration.test_training_api import RECIPE, training_mesh

BASE = "examples/arith/model"
ADAM = AdamParams(learning_rate=1e-2, eps=1e-6)


def _datums(tok, texts: list[str]) -> list[Datum]:
    out = []
    for text in texts:
        ids = tok.encode(text)
        out.append(Datum(ModelInput.from_ints(ids[:-1]), {"target_tokens": ids[1:]}))
    return out


def _course(tc, data: list[Datum], steps: int, barrier: threading.Barrier | None = None) -> None:
    for _ in range(steps):
        tc.forward_backward(data[:1]).result()
        if barrier is not None:
            barrier.wait(timeout=60)            # the other client's calls land between this one's two halves
        tc.forward_backward(data[1:]).result()
        tc.optim_step(ADAM).result()


def _sampler_matches_trainer(tc, tok, prompt: str) -> list[float]:
    """Samples under the client's adapter; its log-probs are the client's trainer log-probs. -> those log-probs."""
    ids = tok.encode(prompt)
    seqs = tc.sample(ModelInput.from_ints(ids), 2, SamplingParams(max_tokens=5, seed=7)).result().sequences
    data = [Datum(ModelInput.from_ints((ids + s.tokens)[:-1]), {"target_tokens": (ids + s.tokens)[1:]}) for s in seqs]
    out = tc.forward_backward(data, "cross_entropy", {}).result()
    for o, s in zip(out.loss_fn_outputs, seqs):
        assert o["logprobs"][len(ids) - 1:] == pytest.approx(s.logprobs, abs=2e-3)
    return [lp for o in out.loss_fn_outputs for lp in o["logprobs"][len(ids) - 1:]]


def _clients(address: str, engine) -> None:
    service = ServiceClient(address)
    a = service.create_lora_training_client(base_model=BASE, rank=8)
    b = service.create_lora_training_client(base_model=BASE, rank=8)
    assert {a.info.adapter, b.info.adapter} == {"client-0", "client-1"}
    tok = a.get_tokenizer()
    data_a = _datums(tok, ["12+30=42", "7+8=15", "40+41=81"])
    data_b = _datums(tok, ["99+1=100", "3+3=6"])
    start = a.save_state("a-start").result()

    # Two threads, each its client's course; the barrier makes their calls interleave.
    barrier = threading.Barrier(2)
    threads = [threading.Thread(target=_course, args=(c, d, 3, barrier)) for c, d in ((a, data_a), (b, data_b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    probe = _datums(tok, ["21+21=42", "5+50=55"])
    after_a = a.forward_backward(probe).result()

    # Each samples under its own adapter: the replicas hold both, the sampler's log-probs are each client's.
    lp_a = _sampler_matches_trainer(a, tok, "12+30=")
    lp_b = _sampler_matches_trainer(b, tok, "12+30=")
    assert lp_a != pytest.approx(lp_b, abs=1e-3)
    b.close()

    # The same course alone, from a's saved start (weights and optimizer state): the same weights.
    c = service.create_lora_training_client(base_model=BASE, rank=8)
    assert c.info.adapter == "client-1"                    # b's freed name, reused
    c.load_state(start).result()
    _course(c, data_a, 3)
    alone = c.forward_backward(probe).result()
    for x, y in zip(after_a.loss_fn_outputs, alone.loss_fn_outputs):
        assert x["logprobs"] == pytest.approx(y["logprobs"], abs=1e-5)
    # The reused name's first Sample replaces b's adapter on the replicas with c's.
    _sampler_matches_trainer(c, tok, "12+30=")
    a.close()
    c.close()
    assert engine.clients == {}
    service.close()


def test_two_clients_train_their_own_adapters_concurrently_and_sample_under_them(tmp_path):
    async def main():
        async with training_mesh(tmp_path) as served:
            await asyncio.to_thread(_clients, *served)

    asyncio.run(main())


@contextlib.asynccontextmanager
async def merged_mesh(tmp_path):
    """The training mesh with a torch replica that serves no adapters (rollout.enable_lora: false)."""
    recipe = copy.deepcopy(RECIPE)
    recipe["training_api"] = {"state_dir": str(tmp_path / "states")}
    recipe["rollout"]["enable_lora"] = False
    mesh = await start_local_mesh(recipe, num_rollout=1, num_reward=0, num_reference=0)
    server, port, engine = await start_training(load_config(TrainingSettings, data=mesh.config), "127.0.0.1:0")
    try:
        yield f"127.0.0.1:{port}", engine
    finally:
        await server.stop(0)
        await engine.close()
        await mesh.stop()


def _merged(address: str, engine) -> None:
    service = ServiceClient(address)
    a = service.create_lora_training_client(base_model=BASE, rank=8)
    b = service.create_lora_training_client(base_model=BASE, rank=8)
    tok = a.get_tokenizer()
    _course(a, _datums(tok, ["12+30=42", "7+8=15"]), 2)
    _sampler_matches_trainer(a, tok, "12+30=")              # a's adapter merged into the replica's base
    assert set(engine.serves.values()) == {""}
    _course(b, _datums(tok, ["99+1=100", "3+3=6"]), 2)
    with pytest.raises(grpc.RpcError) as err:
        b.sample(ModelInput.from_ints(tok.encode("1+1=")), 1, SamplingParams(max_tokens=2)).result()
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "serves no LoRA adapters" in err.value.details() and a.client_id in err.value.details()
    a.close()
    _sampler_matches_trainer(b, b.get_tokenizer(), "12+30=")  # the replica is b's now: its adapter merged
    b.close()
    service.close()


def test_a_replica_without_adapters_serves_one_client_at_a_time_merged(tmp_path):
    async def main():
        async with merged_mesh(tmp_path) as served:
            await asyncio.to_thread(_merged, *served)

    asyncio.run(main())
