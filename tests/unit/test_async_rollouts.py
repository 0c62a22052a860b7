"""k batches in flight (coordinator/training/async_rollouts.py) against a scripted rollout pool: the staleness
bound, the data position of each batch, stale groups regenerated or dropped, and in-flight batches made again
after a restart or a rollback."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from coordinator.recipe.config import RunConfig
from coordinator.recipe.data import Problem, PromptStream
from coordinator.training import async_rollouts, phases
from coordinator.training.remote import Sample

BATCH, N = 3, 2
PROBLEMS = [Problem(id=f"q{i}", prompt=f"{i}+0=", ground_truth=str(i), data_source="arith") for i in range(20)]


class ScriptedPool:
    """phases.generate stand-in: each sample carries the run's weight version when its generation ran, less the
    lag `lag_of(problem id)` at a prompt's first generation (to make stale samples; a regeneration is fresh)."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.calls: list[list[str]] = []
        self.lag_of = lambda pid: 0

    async def generate(self, ctx, problems, sampling=None, *, partial_rollout=False):
        again = {q for call in self.calls for q in call}
        self.calls.append([p.id for p in problems])
        return [Sample(p, g, [1], [5, 6], [-1.0, -1.0], "", "stop",
                       ctx.weight_version - (0 if p.id in again else self.lag_of(p.id)))
                for g, p in enumerate(problems) for _ in range(N)]


def make_ctx(monkeypatch, k: int, stale_samples: str = "regenerate", position: int = 0):
    cfg = RunConfig(run={"async_mode": True, "max_staleness": k, "stale_samples": stale_samples},
                    rollout={"n": N}, data={"rollout_batch_size": BATCH})
    ctx = SimpleNamespace(cfg=cfg, data=PromptStream(PROBLEMS, seed=0, position=position), step=position // BATCH,
                          weight_version=position // BATCH, prefetched=None,
                          sampling_at=lambda step: cfg.rollout.sampling())
    pool = ScriptedPool(ctx)
    monkeypatch.setattr(phases, "generate", pool.generate)
    return ctx, pool


async def steps(ctx, num: int) -> list[tuple[list[str], dict]]:
    """`num` steps as the loop takes them: a batch, then the update (version + 1) and the data position."""
    out = []
    for _ in range(num):
        expected = [p.id for p in ctx.data.take(BATCH)]
        samples, metrics = await async_rollouts.next_batch(ctx, BATCH)
        assert sorted({s.problem.id for s in samples}) == sorted(expected)     # the prompts at the position
        out.append(([s.problem.id for s in samples], metrics))
        await asyncio.sleep(0)     # scoring and training await the services: the batches just launched start
        ctx.data.advance(BATCH)
        ctx.step += 1
        ctx.weight_version += 1
    return out


@pytest.mark.parametrize("k", [1, 2, 3])
def test_k_batches_stay_in_flight_and_no_sample_trains_more_than_k_versions_behind(monkeypatch, k):
    ctx, pool = make_ctx(monkeypatch, k)

    async def main():
        done = await steps(ctx, 6)
        ctx.prefetched.cancel()
        return done

    done = asyncio.run(main())
    assert [m["staleness_max"] for _, m in done] == [min(i, k) for i in range(6)]
    assert all(m["async/in_flight"] == k for _, m in done)
    # Every batch generated once, at its own data position: 6 trained, k still in flight at the end.
    stream = PromptStream(PROBLEMS, seed=0)
    assert pool.calls == [[p.id for p in stream.take(BATCH * (i + 1))[BATCH * i:]] for i in range(6 + k)]


@pytest.mark.parametrize("mode", ["regenerate", "drop"])
def test_a_group_staler_than_k_is_regenerated_or_dropped_and_counted(monkeypatch, mode):
    ctx, pool = make_ctx(monkeypatch, 1, stale_samples=mode)
    first = [p.id for p in ctx.data.take(BATCH)]
    pool.lag_of = lambda pid: 5 if pid == first[1] else 0          # its generation ran on weights 5 versions old

    async def main():
        samples, metrics = await async_rollouts.next_batch(ctx, BATCH)
        ctx.prefetched.cancel()
        return samples, metrics

    samples, metrics = asyncio.run(main())
    assert metrics["staleness_max"] <= 1
    if mode == "regenerate":
        assert (metrics["async/regenerated"], metrics["async/dropped_stale"]) == (N, 0)
        assert pool.calls[-1] == [first[1]] and [s.group for s in samples] == [0, 0, 1, 1, 2, 2]
        assert [s.problem.id for s in samples] == [q for q in first for _ in range(N)]
    else:
        assert (metrics["async/regenerated"], metrics["async/dropped_stale"]) == (0, N)
        assert [s.problem.id for s in samples] == [q for q in first if q != first[1] for _ in range(N)]


def test_a_batch_wholly_stale_is_regenerated_even_in_drop_mode(monkeypatch):
    ctx, pool = make_ctx(monkeypatch, 1, stale_samples="drop")
    pool.lag_of = lambda pid: 3

    async def main():
        _, first = await async_rollouts.next_batch(ctx, BATCH)
        ctx.prefetched.cancel()
        return first

    metrics = asyncio.run(main())
    assert metrics["async/regenerated"] == BATCH * N and metrics["async/dropped_stale"] == 0
    assert metrics["staleness_max"] == 0 and pool.calls[-1] == pool.calls[0]


def test_a_restarted_or_rolled_back_run_generates_the_batches_in_flight_again(monkeypatch):
    ctx, pool = make_ctx(monkeypatch, 2, position=2 * BATCH)          # a coordinator restarted at step 2

    async def main():
        await steps(ctx, 1)
        # A rollback to step 1: the batches in flight (steps 4, 5) no longer follow the run.
        ctx.step, ctx.weight_version = 1, 1
        ctx.data.position = BATCH
        rolled = await steps(ctx, 1)
        ctx.prefetched.cancel()
        return rolled

    rolled = asyncio.run(main())
    stream = PromptStream(PROBLEMS, seed=0)
    at = [[p.id for p in stream.take(BATCH * (i + 1))[BATCH * i:]] for i in range(6)]
    assert pool.calls[:3] == [at[2], at[3], at[4]]                  # from the restart's position on
    assert pool.calls[3:6] == [at[1], at[2], at[3]]                 # after the rollback: from step 2 again
    assert sorted(set(rolled[0][0])) == sorted(at[1])


@pytest.mark.parametrize("data, message", [
    ({"run": {"async_mode": True, "max_staleness": 0}}, "run.max_staleness: 0 keeps no batch in flight"),
    ({"run": {"max_staleness": 2}}, "run.max_staleness: 2 batches in flight need run.async_mode: true"),
    ({"rollout": {"partial_rollouts": "continue"}}, "rollout.partial_rollouts: 'continue' needs run.async_mode"),
    ({"run": {"async_mode": True}, "rollout": {"partial_rollouts": "continue", "engine": "vllm"}},
     "partial_rollouts: 'continue' needs engine 'torch'"),
    ({"run": {"async_mode": True, "stale_samples": "keep"}}, "stale_samples"),
])
def test_async_settings_that_cannot_be_honoured_are_refused_by_name(data, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        RunConfig(**data)


def test_token_staleness_counts_model_tokens_only_not_an_episodes_observations():
    import numpy as np

    problem = Problem(id="p", prompt="1+1=", ground_truth="2", data_source="arith")
    # 2 model tokens at v3, 3 observation tokens (version as recorded), 2 model tokens at v4; the run is at v5.
    s = Sample(problem, 0, np.array([1], np.int32), np.arange(7, dtype=np.int32), np.zeros(7, np.float32), "", "stop", 3,
               loss_mask=np.array([1, 1, 0, 0, 0, 1, 1], np.int8))
    s.weight_versions = [3, 3, 3, 3, 3, 4, 4]
    plain = Sample(problem, 1, np.array([1], np.int32), np.arange(4, dtype=np.int32), np.zeros(4, np.float32), "", "stop", 4,
                   loss_mask=np.array([1, 0, 0, 1], np.int8))
    m = async_rollouts.staleness_metrics(SimpleNamespace(weight_version=5), [s, plain])
    # model tokens: 2 x lag 2 + 2 x lag 1 (episode) + 2 x lag 1 (plain) = 8 over 6 tokens
    assert m["staleness_token_mean"] == pytest.approx(8 / 6)
    assert m["async/partial_samples"] == 1.0
    assert m["staleness_max"] == 2.0
