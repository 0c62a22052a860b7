"""The async loop's ledger (coordinator/training/ledger.py, coordinator/runapi/store.py): a step's commit marks the
groups it took trained in the same atomic write (Redis script and memory store alike), and a restarted coordinator
reloads the generated groups in flight instead of generating them again, regenerating or dropping stale ones."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from coordinator.recipe.data import PromptStream
from coordinator.runapi.store import MemoryStore, RedisStore, RunRecord
from coordinator.training import async_rollouts, ledger
from tests.unit.test_async_rollouts import BATCH, PROBLEMS, make_ctx

LIVE = {0: {"state": "scored", "step": 1}, 1: {"state": "dropped", "step": 1}, 2: {"state": "filtered", "step": 1},
        3: {"state": "generated", "step": 1, "version": 0},          # below the position, not taken: unsettled
        4: {"state": "generating", "step": 2, "version": 0}, 5: {"state": "scored", "step": 2}}


async def _commit_twice_then_roll_back(store) -> tuple[list, list, list, list]:
    book = store.ledger("r")
    await book.put(LIVE, {0: "[]", 4: "[]"})
    record = RunRecord(run_id="r", config="", step=1, data_position=4)
    metrics = {"step": 1, "reward_mean": 0.5}
    await store.commit(record, metrics)
    await store.commit(record, metrics)               # a retry after a lost reply settles nothing twice
    after_one = (await book.settled(), sorted((await book.live()).items()))
    record.step, record.data_position = 2, 8
    await store.commit(record, {"step": 2, "reward_mean": 0.5})
    after_two = await book.settled()
    record.step, record.data_position = 1, 4
    await store.rollback(record)
    return *after_one, after_two, [await book.settled(), await book.live()]


def _expect(settled, live, after_two, rolled_back):
    assert settled == [{"step": 1, "trained": [0], "dropped": [1], "filtered": [2], "unsettled": [3]}]
    assert live == [(4, (LIVE[4], "[]")), (5, (LIVE[5], None))]
    assert after_two == settled + [{"step": 2, "trained": [5], "unsettled": [4]}]
    # Set back to step 1: step 2's marks go (it trains again), and what was in flight is generated again.
    assert rolled_back == [settled, {}]


def test_a_memory_store_commit_settles_the_ledger_below_the_committed_position_once():
    _expect(*asyncio.run(_commit_twice_then_roll_back(MemoryStore())))


@pytest.mark.redis
def test_the_redis_commit_script_settles_the_ledger_as_the_memory_store_does(redis_url):
    async def main():
        store = RedisStore(redis_url, prefix=f"meshrl-ledger-{uuid.uuid4().hex[:8]}")
        try:
            return await _commit_twice_then_roll_back(store)
        finally:
            await store.close()

    _expect(*asyncio.run(main()))


@pytest.mark.redis
def test_a_finished_runs_commit_empties_its_live_ledger(redis_url):
    async def main():
        store = RedisStore(redis_url, prefix=f"meshrl-ledger-{uuid.uuid4().hex[:8]}")
        book = store.ledger("r")
        await book.put({12: {"state": "generated", "step": 4, "version": 2}}, {12: "[]"})
        await store.commit(RunRecord(run_id="r", config="", step=3, data_position=12, state="COMPLETED"),
                           {"step": 3, "final": 1.0})
        live, settled = await book.live(), await book.settled()
        await store.close()
        return live, settled

    assert asyncio.run(main()) == ({}, [])


def test_a_groups_samples_survive_the_ledger_bit_for_bit(monkeypatch):
    ctx, pool = make_ctx(monkeypatch, 2)
    samples = asyncio.run(pool.generate(ctx, PROBLEMS[:1]))
    samples[0].weight_versions = [3, 4]
    back = ledger.decode(ledger.encode(samples), PROBLEMS[0], 0)
    for a, b in zip(samples, back):
        assert (a.problem, a.group, a.text, a.finish_reason, a.weight_version) == \
            (b.problem, b.group, b.text, b.finish_reason, b.weight_version)
        assert list(a.prompt_ids) == b.prompt_ids.tolist() and list(a.response_ids) == b.response_ids.tolist()
        assert list(a.rollout_logprobs) == b.rollout_logprobs.tolist() and a.loss_mask is b.loss_mask is None
    assert back[0].weight_versions.tolist() == [3, 4] and back[1].weight_versions is None


# --- a restart of the coordinator against a scripted rollout pool ---------------------------------------------

async def _run_steps(ctx, store, num: int) -> list[dict]:
    """`num` steps as the loop takes them, each committed with its record's data position."""
    out = []
    for _ in range(num):
        samples, metrics = await async_rollouts.next_batch(ctx, BATCH)
        await asyncio.sleep(0)
        ctx.data.advance(BATCH)
        await async_rollouts.stage_step(ctx, samples)
        ctx.step += 1
        ctx.weight_version += 1
        await store.commit(RunRecord(run_id="r", config="", step=ctx.step, data_position=ctx.data.position),
                           {"step": ctx.step})
        out.append(metrics)
    return out


def _with_ledger(ctx, store):
    ctx.ledger, ctx.run_id = store.ledger("r"), "r"
    return ctx


@pytest.mark.parametrize("lag, stale_samples, expect", [
    (0, "regenerate", {"async/groups_recovered": BATCH, "async/groups_regenerated": BATCH,
                       "async/groups_dropped_stale": 0}),
    (3, "regenerate", {"async/groups_recovered": 0, "async/groups_regenerated": 2 * BATCH,
                       "async/groups_dropped_stale": 0}),
    # Every group of the batch stale: regenerated under drop too (a step trains on something).
    (3, "drop", {"async/groups_recovered": 0, "async/groups_regenerated": 2 * BATCH,
                 "async/groups_dropped_stale": 0}),
])
def test_a_restarted_coordinator_reloads_the_generated_groups_in_flight_and_generates_the_rest(
        monkeypatch, lag, stale_samples, expect):
    store = MemoryStore()
    ctx, pool = make_ctx(monkeypatch, 2, stale_samples)
    _with_ledger(ctx, store)

    async def main():
        await _run_steps(ctx, store, 2)
        # In flight: step 3's batch generated and kept; step 4's still generating when the coordinator dies (its
        # entries say generating, with no samples).
        flight = ctx.prefetched
        assert [b.step for b in flight.batches] == [3, 4]
        await flight.batches[0].task
        flight.cancel()
        await ctx.ledger.put({p: {"state": "generating", "step": 4, "version": 1} for p in range(9, 12)})
            # The restarted coordinator: a fresh context at the committed position, `lag` versions further on.
        again, pool2 = make_ctx(monkeypatch, 2, stale_samples, position=2 * BATCH)
        again.weight_version += lag
        _with_ledger(again, store)
        metrics = await _run_steps(again, store, 3)
        again.prefetched.cancel()
        return pool2.calls, metrics

    calls, metrics = asyncio.run(main())
    assert {k: metrics[0][k] for k in ledger.RESTART_KEYS} == expect
    assert all(m[k] == 0 for m in metrics[1:] for k in ledger.RESTART_KEYS)
    stream = PromptStream(PROBLEMS, seed=0)
    # The first generation after the restart: step 4's batch when step 3's was reloaded, else step 3's again.
    first = 3 * BATCH if lag == 0 else 2 * BATCH
    assert calls[0] == [p.id for p in stream.take(BATCH, at=first)]
    # Exactly once: every group of steps 1..5 settled once, by the step of its data position, none unsettled.
    settled = asyncio.run(store.ledger("r").settled())
    assert [line["step"] for line in settled] == [1, 2, 3, 4, 5]
    for line in settled:
        assert set(line) == {"step", "trained"} and line["trained"] == list(range((line["step"] - 1) * BATCH,
                                                                                   line["step"] * BATCH))
    assert all(m["staleness_max"] <= 2 for m in metrics)


def test_stale_groups_reloaded_at_a_restart_are_dropped_under_drop_and_settled_as_dropped(monkeypatch):
    store = MemoryStore()
    ctx, pool = make_ctx(monkeypatch, 2, "drop", position=BATCH)
    _with_ledger(ctx, store)
    problems = ctx.data.take(BATCH)

    async def main():
        # The batch at the committed position: one group generated at version 0 (3 behind at restart: stale), one
        # fresh, one still generating.
        old = await pool.generate(ctx, problems[:2])
        for s in old:
            s.weight_version = 0 if s.group == 0 else ctx.weight_version
        await ledger.generated(ctx, 2, BATCH, old)
        await ctx.ledger.put({BATCH + 2: {"state": "generating", "step": 2, "version": 1}})
        ctx.weight_version = 3
        metrics = await _run_steps(ctx, store, 1)
        ctx.prefetched.cancel()
        return metrics[0]

    metrics = asyncio.run(main())
    assert {k: metrics[k] for k in ledger.RESTART_KEYS} == {"async/groups_recovered": 1,
                                                            "async/groups_regenerated": 1,
                                                            "async/groups_dropped_stale": 1}
    # Only the generating group is generated again (the first call made the batch before the restart).
    assert pool.calls[1] == [problems[2].id] and all(problems[1].id not in c for c in pool.calls[1:])
    (line,) = asyncio.run(store.ledger("r").settled())
    assert line == {"step": 2, "trained": [BATCH + 1, BATCH + 2], "dropped": [BATCH]}
    assert metrics["async/in_flight"] == 2


def test_a_step_taking_two_batches_marks_the_groups_it_left_out_filtered_and_settles_them_with_it(monkeypatch):
    """algorithm.filter_groups: a step generates batches until it holds enough groups with reward variance; the
    groups it took but does not train on are consumed all the same, settled as filtered by that step."""
    store = MemoryStore()
    ctx, pool = make_ctx(monkeypatch, 2)
    _with_ledger(ctx, store)

    async def main():
        first, _ = await async_rollouts.next_batch(ctx, BATCH)
        second, _ = await async_rollouts.next_batch(ctx, BATCH, offset=BATCH)
        trained = [s for s in first if s.group == 1] + [s for s in second if s.group != 0]
        ctx.data.advance(2 * BATCH)
        await async_rollouts.stage_step(ctx, trained)
        ctx.step, ctx.weight_version = 1, 1
        await store.commit(RunRecord(run_id="r", config="", step=1, data_position=2 * BATCH), {"step": 1})
        ctx.prefetched.cancel()
        return await store.ledger("r").settled(), await store.ledger("r").live()

    settled, live = asyncio.run(main())
    assert settled == [{"step": 1, "trained": [1, BATCH + 1, BATCH + 2], "filtered": [0, 2, BATCH]}]
    # What stays in flight is past the committed position, untouched.
    assert live and min(live) >= 2 * BATCH


def test_groups_marked_for_an_update_that_never_ran_are_generated_again_and_trained_once(monkeypatch):
    """The coordinator died between a step's ledger marks and its update: the marks were never committed, so the
    restarted coordinator generates those groups again and the step that trains them settles them once."""
    store = MemoryStore()
    ctx, pool = make_ctx(monkeypatch, 1)
    _with_ledger(ctx, store)

    async def main():
        samples, _ = await async_rollouts.next_batch(ctx, BATCH)
        await async_rollouts.stage_step(ctx, samples)           # then the crash: no update, no commit
        ctx.prefetched.cancel()
        again, pool2 = make_ctx(monkeypatch, 1)
        _with_ledger(again, store)
        metrics = await _run_steps(again, store, 1)
        again.prefetched.cancel()
        return pool2.calls, metrics[0], await store.ledger("r").settled()

    calls, metrics, settled = asyncio.run(main())
    assert calls[0] == [p.id for p in PromptStream(PROBLEMS, seed=0).take(BATCH)]
    # The marked batch is generated again (first call); the one behind it (k = 1) reloaded or generated again.
    assert metrics["async/groups_regenerated"] >= BATCH
    assert metrics["async/groups_recovered"] + metrics["async/groups_regenerated"] == 2 * BATCH
    assert settled == [{"step": 1, "trained": list(range(BATCH))}]
