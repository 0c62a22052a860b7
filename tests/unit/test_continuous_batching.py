"""Continuous batching in the torch engine's graph decode (services/rollout/engine_torch/continuous.py) and its paged
KV cache's decode (paged/decoder.py): requests that arrive mid-decode join it in freed batch rows (the paged decode:
between windows, while the batch has room) and each request is answered when its own rows ended. On CPU the graph
decoder runs its step eagerly (use_graphs=False; no Triton sampler or attention), the paged decoder its eager steps."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.rollout.config import RolloutSettings
from services.rollout.engine_torch.cuda_decode import GraphDecoder, Joiner
from services.rollout.engine_torch.engine import TorchEngine
from services.rollout.testing import Gate, make_tiny_model, random_state_like
from services.rollout.types import GenerateBatch, PromptInput, SamplingParams

PROMPTS = [[4, 5, 13, 6, 15], [7, 3, 9, 12, 8, 10, 11], [20]]
JOINERS = [[9, 9, 8], [5, 6, 7, 8, 9, 10]]
SYNC = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("continuous_model"), max_position_embeddings=128)


def cpu_graph_engine(path: str, **rollout) -> TorchEngine:
    """A CPU engine with the graph decoder: the engine refuses rollout.cuda_graphs without CUDA, so the test sets
    the same decoder, its step run eagerly, in its place."""
    e = TorchEngine(RolloutSettings(model={"path": path}, rollout={"max_batch_size": 4, **rollout}))
    e._graph_decoder = GraphDecoder(e.model, pad_id=e.pad_id, eos_ids=sorted(e.eos_ids), max_batch_size=4,
                                    use_graphs=False, compile=False, sync_every=SYNC)
    return e


def cpu_paged_engine(path: str, **rollout) -> TorchEngine:
    return TorchEngine(RolloutSettings(model={"path": path}, rollout={"max_batch_size": 4, "kv_cache": "paged",
                                                                      **rollout}))


ENGINES = {"graph": cpu_graph_engine, "paged": cpu_paged_engine}


def request(prompts, i=0, **sampling) -> GenerateBatch:
    partial = sampling.pop("partial", "off")
    return GenerateBatch([PromptInput(id=f"r{i}p{j}", prompt_ids=list(p)) for j, p in enumerate(prompts)],
                         SamplingParams(**sampling), partial_rollout=partial)


async def pending(engine: TorchEngine, n: int) -> None:
    """Until n requests queue (each generate task queues on its first loop turn)."""
    for _ in range(1000):
        if len(engine._pending) >= n:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{n} requests never queued")


def same_as_alone(got, alone) -> None:
    for r, a in zip(got, alone):
        assert r.prompt_id == a.prompt_id and r.prompt_ids == a.prompt_ids
        for s, t in zip(r.samples, a.samples):
            assert s.response_ids == t.response_ids and s.finish_reason == t.finish_reason
            assert s.logprobs == pytest.approx(t.logprobs, abs=1e-4)


@pytest.mark.parametrize("top_logprobs", [0, 3])
def test_rows_that_join_mid_decode_give_the_tokens_and_logprobs_they_give_alone(model_dir, top_logprobs):
    e = TorchEngine(RolloutSettings(model={"path": model_dir}))
    dec = GraphDecoder(e.model, pad_id=0, eos_ids=[2], max_batch_size=8, use_graphs=False, compile=False,
                       sync_every=SYNC)
    budgets, join_budgets = [6, 30, 10], [12, 20]
    alone = [dec.decode([q], [b], [0.0], [1.0], top_logprobs=top_logprobs)
             for q, b in zip(PROMPTS + JOINERS, budgets + join_budgets)]
    waiting = [Joiner(q, b, 0.0, 1.0) for q, b in zip(JOINERS, join_budgets)]
    rooms, ended = [], []

    def join(room):
        rooms.append(room)
        if room.step < 2 * SYNC:                   # join at the second sync, into row 0's freed batch row and more
            return []
        take = [j for j in waiting if room.fits(len(j.prompt), j.budget)][:room.free]
        for j in take:
            waiting.remove(j)
        return take

    out = dec.decode(PROMPTS, budgets, [0.0] * 3, [1.0] * 3, top_logprobs=top_logprobs, join=join,
                     ended=lambda rows: ended.append(sorted(rows)))
    assert dec.stats["joined_rows"] == 2 and not waiting
    assert [r.step for r in rooms][:2] == [SYNC, 2 * SYNC] and rooms[1].slot == max(map(len, PROMPTS)) + 2 * SYNC
    assert ended[0] == [0] and ended[-1] == [1]    # row 0 ends first; row 1 (30 tokens) after the joiners
    for i, a in enumerate(alone):
        assert out.tokens[i] == a.tokens[0] and len(out.tokens[i]) == (budgets + join_budgets)[i]
        assert out.logprobs[i] == pytest.approx(a.logprobs[0], abs=1e-5)
        if top_logprobs:
            # with join, every recorded top entry comes back (a joiner may ask for more than the first rows)
            assert [[t for t, _ in step[:3]] for step in out.top[i]] == [[t for t, _ in step] for step in a.top[0]]


@pytest.mark.parametrize("kind", ENGINES)
def test_a_request_is_answered_before_the_decode_ends_when_another_joined(model_dir, kind):
    eager = TorchEngine(RolloutSettings(model={"path": model_dir}))
    first, second = request(PROMPTS[:1], 0, n=2, temperature=0, max_tokens=12), \
        request(JOINERS[:1], 1, n=2, temperature=0, max_tokens=40)
    alone = [asyncio.run(eager.generate(b)) for b in (first, second)]
    e = ENGINES[kind](model_dir)
    hold = 30                                       # a call after the first request's rows ended (step 12)

    async def go():
        gate = Gate(e.model.model.embed_tokens, (3, hold))
        try:
            a = asyncio.ensure_future(e.generate(first))
            await gate.wait(3)                      # the decode runs (step 1)
            b = asyncio.ensure_future(e.generate(second))
            await pending(e, 1)
            gate.open(3)
            await gate.wait(hold)                   # the second request's rows still decode ...
            got_a = await asyncio.wait_for(a, 60)   # ... and the first one is answered meanwhile
            assert not b.done()
            gate.open(hold)
            return got_a, await b
        finally:
            gate.handle.remove()

    got = asyncio.run(go())
    assert e.stats["joined_rows"] == 2 and e.stats["decode_batches"] == 1 and e.stats["requests"] == 2
    for g, a in zip(got, alone):
        same_as_alone(g, a)


@pytest.mark.parametrize("kind", ENGINES)
def test_many_requests_of_different_lengths_join_with_nothing_lost_or_duplicated(model_dir, kind):
    eager = TorchEngine(RolloutSettings(model={"path": model_dir}))
    shapes = [(PROMPTS[:1], 2, 9), (PROMPTS[1:], 1, 25), (JOINERS, 2, 6), (PROMPTS, 1, 17), (JOINERS[1:], 3, 30),
              (PROMPTS[2:], 2, 4)]
    batches = [request(p, i, n=n, temperature=0, max_tokens=t) for i, (p, n, t) in enumerate(shapes)]
    alone = [asyncio.run(eager.generate(b)) for b in batches]
    e = ENGINES[kind](model_dir)

    async def go():
        gate = Gate(e.model.model.embed_tokens, (1,))
        try:
            tasks = [asyncio.ensure_future(e.generate(batches[0]))]
            await gate.wait(1)                      # the first request's prefill: the others queue meanwhile
            tasks += [asyncio.ensure_future(e.generate(b)) for b in batches[1:]]
            await pending(e, len(batches) - 1)
            gate.open(1)
            return await asyncio.gather(*tasks)
        finally:
            gate.handle.remove()

    got = asyncio.run(go())
    rows = sum(len(p) * n for p, n, _ in shapes)
    assert e.stats["decode_batches"] == 1 and e.stats["samples"] == rows
    assert e.stats["joined_rows"] == rows - 2       # all but the first request's rows joined
    for g, a in zip(got, alone):
        same_as_alone(g, a)


@pytest.mark.parametrize("kind", ENGINES)
def test_seeded_and_stop_string_requests_wait_for_the_next_decode_and_block_later_ones(model_dir, kind):
    eager = TorchEngine(RolloutSettings(model={"path": model_dir}))
    free = asyncio.run(eager.generate(request(PROMPTS, n=1, temperature=0, max_tokens=30)))
    stops = [free[1].samples[0].text[6:8]]
    first = request(PROMPTS[:1], 0, n=2, temperature=0, max_tokens=20)
    others = [request(PROMPTS[1:2], 1, n=2, temperature=1.0, max_tokens=12, seed=7),
              request(PROMPTS, 2, n=1, temperature=0, max_tokens=30, stop=stops),
              request(JOINERS, 3, n=1, temperature=0, max_tokens=10)]      # joinable, but behind the others
    alone = [asyncio.run(eager.generate(b)) for b in [first] + others]
    e = ENGINES[kind](model_dir)

    async def go():
        gate = Gate(e.model.model.embed_tokens, (3,))
        try:
            tasks = [asyncio.ensure_future(e.generate(first))]
            await gate.wait(3)
            tasks += [asyncio.ensure_future(e.generate(b)) for b in others]
            await pending(e, len(others))
            gate.open(3)
            return await asyncio.gather(*tasks)
        finally:
            gate.handle.remove()

    got = asyncio.run(go())
    assert e.stats["joined_rows"] == 0 and e.stats["decode_batches"] == 2 and e.stats["requests"] == 4
    for g, a in zip(got, alone):
        same_as_alone(g, a)
    assert any(s.finish_reason == "stop" for r in got[2] for s in r.samples)


def test_a_weight_swap_between_steps_tags_the_joined_rows_tokens_from_their_own_start(model_dir):
    e = cpu_graph_engine(model_dir)
    first = request(PROMPTS[:1], 0, n=1, temperature=0, max_tokens=40, partial="continue")
    second = request(JOINERS[:1], 1, n=1, temperature=0, max_tokens=40, partial="continue")
    reference = asyncio.run(e.generate(second))[0].samples[0]           # old weights, alone
    swap_at = 12                                    # the call (step 10) during which the update is posted

    async def go():
        gate = Gate(e.model.model.embed_tokens, (3, swap_at))
        try:
            a = asyncio.ensure_future(e.generate(first))
            await gate.wait(3)
            b = asyncio.ensure_future(e.generate(second))
            await pending(e, 1)
            gate.open(3)                            # joins at the sync after step 3: its token 0 is step 4
            await gate.wait(swap_at)
            update = asyncio.ensure_future(e.apply_update(1, random_state_like(e.model, seed=1)))
            await asyncio.sleep(0)                  # one loop turn: the update posts its swap
            gate.open(swap_at)
            await update                            # lands at the sync after step 11
            return (await a)[0].samples[0], (await b)[0].samples[0]
        finally:
            gate.handle.remove()

    a, b = asyncio.run(go())
    assert e.stats["joined_rows"] == 1 and e.stats["swaps_mid_generation"] == 1
    assert a.weight_versions == [0] * 13 + [1] * 27       # token 13 is the first of the new weights (step 13)
    assert b.weight_versions == [0] * 9 + [1] * 31        # the same step, 4 steps into the joined row
    assert a.weight_version == b.weight_version == 0
    assert b.response_ids[:9] == reference.response_ids[:9]
    assert b.logprobs[:9] == pytest.approx(reference.logprobs[:9], abs=1e-5)
    assert b.response_ids[9:] != reference.response_ids[9:]


@pytest.mark.parametrize("kind", ENGINES)
def test_a_posted_update_stops_joining_so_it_lands_before_the_next_requests(model_dir, kind):
    e = ENGINES[kind](model_dir)
    first = request(PROMPTS[:1], 0, n=1, temperature=0, max_tokens=30)

    async def go():
        gate = Gate(e.model.model.embed_tokens, (3,))
        try:
            a = asyncio.ensure_future(e.generate(first))
            await gate.wait(3)
            update = asyncio.ensure_future(e.apply_update(1, random_state_like(e.model, seed=2)))
            await asyncio.sleep(0)                  # one loop turn: the update posts its swap, waits for the lock
            b = asyncio.ensure_future(e.generate(request(JOINERS, 1, n=1, temperature=0, max_tokens=10)))
            await pending(e, 1)
            gate.open(3)
            return await a, await b, await update
        finally:
            gate.handle.remove()

    a, b, _ = asyncio.run(go())
    assert e.stats["joined_rows"] == 0 and e.weight_version == 1
    assert [s.weight_version for r in a for s in r.samples] == [0]
    assert [s.weight_version for r in b for s in r.samples] == [1, 1]


@pytest.mark.parametrize("kind", ENGINES)
def test_continuous_batching_off_keeps_whole_batch_decodes(model_dir, kind):
    e = ENGINES[kind](model_dir, continuous_batching=False)
    first = request(PROMPTS[:1], 0, n=2, temperature=0, max_tokens=20)

    async def go():
        gate = Gate(e.model.model.embed_tokens, (3,))
        try:
            a = asyncio.ensure_future(e.generate(first))
            await gate.wait(3)
            b = asyncio.ensure_future(e.generate(request(JOINERS, 1, n=1, temperature=0, max_tokens=10)))
            await pending(e, 1)
            gate.open(3)
            return await asyncio.gather(a, b)
        finally:
            gate.handle.remove()

    asyncio.run(go())
    assert e.stats["joined_rows"] == 0 and e.stats["decode_batches"] == 2
    assert (e._graph_decoder.stats["replays"] if kind == "graph" else e._paged.stats["decode_steps"]) > 0
