"""DAPO's dynamic sampling (coordinator/training/dynamic_sampling.py) against a scripted rollout pool and reward: groups
without variance dropped, the batch refilled from the next prompts, the bound respected, the metrics, and the data
position moving past every prompt generated (sync and async); the overlong penalty; the settings and verl keys."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import numpy as np
import pytest

from coordinator.cli.runs import step_line
from coordinator.recipe import verl_keys
from coordinator.recipe.config import RunConfig
from coordinator.recipe.data import Problem, PromptStream
from coordinator.recipe.no_signal import ShortBatchWatch
from coordinator.training import dynamic_sampling, phases
from coordinator.training.context import PhaseTimer
from coordinator.training.dynamic_sampling import GroupFilter, varied_groups
from coordinator.training.remote import Sample

BATCH, N = 4, 4
PROBLEMS = [Problem(id=f"q{i}", prompt=f"{i}+0=", ground_truth=str(i), data_source="arith") for i in range(40)]


def sample(pid: str, group: int, reward: float, length: int = 2, error: str = "") -> Sample:
    p = Problem(id=pid, prompt="", ground_truth="", data_source="arith")
    s = Sample(p, group, np.array([1], np.int32), np.arange(length, dtype=np.int32), np.zeros(length, np.float32),
               "", "stop", 0, reward=reward)
    s.reward_error = error
    return s


class Scripted:
    """phases.generate and phases.score stand-ins: a prompt in `varied` gets rewards 1, 0, 1, 0 over its group,
    any other prompt all 0 (no variance)."""

    def __init__(self, monkeypatch, ctx):
        self.ctx = ctx
        self.calls: list[list[str]] = []
        self.varied: set[str] = set()
        monkeypatch.setattr(phases, "generate", self.generate)
        monkeypatch.setattr(phases, "score", self.score)
        self.measured: list[list[Sample]] = []
        monkeypatch.setattr(phases, "score_and_measure", self.measure)

    async def generate(self, ctx, problems, sampling=None, *, partial_rollout=False):
        self.calls.append([p.id for p in problems])
        return [Sample(p, g, np.array([1], np.int32), np.array([5, 6], np.int32), np.zeros(2, np.float32), "",
                       "stop", ctx.weight_version) for g, p in enumerate(problems) for _ in range(N)]

    async def score(self, ctx, samples):
        for i, s in enumerate(samples):
            s.reward = float(s.problem.id in self.varied and i % 2 == 0)

    async def measure(self, ctx, samples, timer, *, scored=False):
        assert scored                     # the filter scored every batch already
        self.measured.append(samples)


def make_ctx(monkeypatch, *, max_batches: int = 0, async_mode: bool = False):
    cfg = RunConfig(algorithm={"filter_groups": {"enable": True, "metric": "score",
                                                 "max_num_gen_batches": max_batches}},
                    run={"async_mode": async_mode}, rollout={"n": N}, data={"rollout_batch_size": BATCH})
    ctx = SimpleNamespace(cfg=cfg, data=PromptStream(PROBLEMS, seed=0), step=0, weight_version=0, prefetched=None,
                          sampling_at=lambda *a: cfg.rollout.sampling(), said=set())
    return ctx, Scripted(monkeypatch, ctx)


def at(start: int, count: int) -> list[str]:
    return [p.id for p in PromptStream(PROBLEMS, seed=0).take(count, at=start)]


async def step(ctx):
    """A step as coordinator/training/loop.py takes it: samples, then the data position, then the update."""
    samples, metrics, consumed = await dynamic_sampling.generate_and_score(ctx, BATCH, PhaseTimer())
    ctx.data.advance(consumed)
    ctx.step += 1
    ctx.weight_version += 1
    return samples, metrics, consumed


def test_a_group_whose_samples_all_score_the_same_is_dropped_and_the_batch_refilled(monkeypatch):
    ctx, pool = make_ctx(monkeypatch)
    pool.varied = set(at(0, 1) + at(BATCH, 3) + at(2 * BATCH, BATCH))    # 1 group of batch 1, 3 of batch 2
    samples, metrics, consumed = asyncio.run(step(ctx))
    assert pool.calls == [at(0, BATCH), at(BATCH, BATCH)]                  # two batches, the next prompts
    assert sorted({s.problem.id for s in samples}) == sorted(at(0, 1) + at(BATCH, 3))
    assert [s.group for s in samples] == [g for g in range(BATCH) for _ in range(N)]
    assert varied_groups(samples, "score") == set(range(BATCH))           # nothing without variance trains
    assert metrics["train/num_gen_batches"] == 2 and metrics["train/frac_groups_dropped"] == 4 / 8
    assert (metrics["train/num_groups"], metrics["train/num_groups_short"]) == (BATCH, 0)
    # Every prompt generated is consumed: the next step starts after both batches.
    assert consumed == 2 * BATCH and ctx.data.position == 2 * BATCH and pool.measured == [samples]


def test_kept_groups_beyond_the_batch_are_trimmed_and_their_prompts_consumed(monkeypatch):
    ctx, pool = make_ctx(monkeypatch)
    pool.varied = set(at(0, 2) + at(BATCH, BATCH))       # 2 + 4 kept: the batch takes 4
    samples, metrics, consumed = asyncio.run(step(ctx))
    assert sorted({s.problem.id for s in samples}) == sorted(at(0, 2) + at(BATCH, 2))
    assert consumed == 2 * BATCH and metrics["train/frac_groups_dropped"] == 2 / 8


def test_the_bound_stops_the_step_short_and_it_trains_on_what_it_kept_said_once(monkeypatch, caplog):
    ctx, pool = make_ctx(monkeypatch, max_batches=2)
    pool.varied = {at(0, 1)[0], at(2 * BATCH, 1)[0]}      # one group with variance in 2 batches
    with caplog.at_level(logging.WARNING, logger="meshrl.coordinator"):
        first = asyncio.run(step(ctx))
        second = asyncio.run(step(ctx))
    for (samples, metrics, consumed), start in ((first, 0), (second, 2 * BATCH)):
        assert metrics["train/num_gen_batches"] == 2 and consumed == 2 * BATCH
        assert (metrics["train/num_groups"], metrics["train/num_groups_short"]) == (1, BATCH - 1)
        assert {s.problem.id for s in samples} == {at(start, 1)[0]}
    assert len(pool.calls) == 4 and ctx.data.position == 4 * BATCH
    assert sum("max_num_gen_batches=2 reached" in r.message for r in caplog.records) == 1


def test_a_step_that_keeps_no_group_trains_on_its_last_batch_as_it_is(monkeypatch):
    ctx, pool = make_ctx(monkeypatch, max_batches=3)
    samples, metrics, consumed = asyncio.run(step(ctx))
    assert [s.problem.id for s in samples] == [q for q in at(2 * BATCH, BATCH) for _ in range(N)]
    assert metrics["train/frac_groups_dropped"] == 1.0 and metrics["train/num_groups_short"] == BATCH
    assert consumed == 3 * BATCH


def test_async_steps_take_several_batches_from_the_queue_each_generated_once_at_its_position(monkeypatch):
    ctx, pool = make_ctx(monkeypatch, async_mode=True)
    # Step 1 needs batches 1 and 2, step 2 batch 3 alone, step 3 batches 4 and 5.
    pool.varied = set(at(0, 2) + at(BATCH, 2) + at(2 * BATCH, BATCH) + at(3 * BATCH, 3) + at(4 * BATCH, 1))

    async def main():
        out = [await step(ctx) for _ in range(3)]
        ctx.prefetched.cancel()
        return out

    done = asyncio.run(main())
    assert [m["train/num_gen_batches"] for _, m, _ in done] == [2, 1, 2]
    assert ctx.data.position == 5 * BATCH
    # Each batch generated once, in position order, one more still in flight (max_staleness 1).
    assert pool.calls == [at(i * BATCH, BATCH) for i in range(6)]
    assert all(varied_groups(s, "score") == set(range(BATCH)) for s, _, _ in done)
    assert all(m["staleness_max"] <= 1 and "async/in_flight" in m for _, m, _ in done)


def test_the_filter_metric_picks_what_must_vary():
    # All right, but one sample long: the score is flat, the reward with the overlong penalty is not.
    group = [sample("a", 0, 1.0) for _ in range(3)] + [sample("a", 0, 0.5)]
    group[-1].overlong_penalty = -0.5
    group[0].reward_extras["acc"] = 1.0
    assert varied_groups(group, "score") == set() and varied_groups(group, "acc") == set()
    assert varied_groups(group, "seq_reward") == {0}
    # A sample the reward failed on does not count; one scored sample has no variance.
    assert varied_groups([sample("b", 1, 1.0), sample("b", 1, 0.0, error="boom")], "score") == set()


def test_group_filter_counts_every_group_it_saw():
    f = GroupFilter(target=2, metric="score", max_batches=0)
    f.add([sample("a", 0, 1.0), sample("a", 0, 0.0), sample("b", 1, 1.0), sample("b", 1, 1.0)])
    assert not f.done
    f.add([sample("c", 0, 0.0), sample("c", 0, 0.0), sample("d", 1, 0.0), sample("d", 1, 1.0)])
    assert f.done and [s.problem.id for s in f.batch()] == ["a", "a", "d", "d"]
    assert f.metrics() == {"train/num_gen_batches": 2.0, "train/frac_groups_dropped": 0.5,
                           "train/num_groups": 2.0, "train/num_groups_short": 0.0}


@pytest.mark.parametrize("length, penalty", [(3, 0.0), (4, 0.0), (5, -0.25), (6, -0.5)])
def test_the_overlong_penalty_grows_linearly_over_the_buffer(length, penalty):
    # verl: max_len 6, buffer 2, factor 0.5 -> 0 up to 4 tokens, -0.5 at 6.
    assert phases.overlong_penalty(length, 6, 2, 0.5) == pytest.approx(penalty)


def test_the_overlong_penalty_is_added_to_the_reward_and_kept_out_of_accuracy(monkeypatch):
    from coordinator.training import reporting

    cfg = RunConfig(algorithm={"overlong_buffer": {"enable": True, "len": 2}}, rollout={"max_tokens": 6})
    samples = [sample("a", 0, 0.0, length=4), sample("a", 0, 0.0, length=6)]

    async def score(ctx, batch):
        for s in batch:
            s.reward = 1.0

    monkeypatch.setattr(phases, "score", score)
    asyncio.run(phases.score_shaped(SimpleNamespace(cfg=cfg), samples))
    assert [s.reward for s in samples] == [1.0, 0.0]
    assert [reporting.success(s) for s in samples] == [1.0, 1.0]


@pytest.mark.parametrize("data, message", [
    ({"algorithm": {"filter_groups": {"enable": True}}, "rollout": {"n": 1}},
     "algorithm.filter_groups.enable: a group of rollout.n=1"),
    ({"algorithm": {"kind": "dpo", "filter_groups": {"enable": True}}}, "algorithm.filter_groups.enable: filters"),
    ({"algorithm": {"filter_groups": {"max_num_gen_batches": -1}}}, "max_num_gen_batches"),
    ({"algorithm": {"overlong_buffer": {"enable": True, "len": 7}}, "rollout": {"max_tokens": 6}},
     r"algorithm.overlong_buffer.len: 7 must be in \[1, rollout.max_tokens=6\]"),
    ({"algorithm": {"overlong_buffer": {"enable": True, "len": 2}}, "rollout": {"agent": {"name": "tool_agent"}}},
     "algorithm.overlong_buffer.enable: measures one response"),
])
def test_dapo_settings_that_cannot_be_honoured_are_refused_by_name(data, message):
    with pytest.raises(ValueError, match=message):
        RunConfig(**data)


def test_verls_dapo_keys_set_meshrls():
    given = verl_keys.parse(["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
                             "algorithm.filter_groups.max_num_gen_batches=-1", "actor_rollout_ref.rollout.n=4",
                             "reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=4",
                             "reward_model.overlong_buffer.penalty_factor=0.5", "data.max_response_length=16"])
    _, cfg = verl_keys.apply(given, lambda d: RunConfig(**d))
    a = cfg.algorithm
    assert (a.filter_groups.enable, a.filter_groups.metric, a.filter_groups.max_num_gen_batches) == (True, "acc", 0)
    assert (a.overlong_buffer.enable, a.overlong_buffer.len, a.overlong_buffer.penalty_factor) == (True, 4, 0.5)
    refused = verl_keys.parse(["algorithm.filter_groups.metric=seq_final_reward"])
    assert refused.problems and "algorithm.filter_groups.metric=seq_final_reward" in refused.problems[0]


def test_the_step_line_says_how_many_generation_batches_and_a_short_step_is_said_once():
    m = {"step": 3, "reward_mean": 0.5, "train/num_gen_batches": 2, "train/num_groups": 12,
         "train/num_groups_short": 4}
    assert "gen 2" in step_line(m, 10) and "gen" not in step_line({"step": 3, "reward_mean": 0.5}, 10)
    watch = ShortBatchWatch()
    assert watch.update({**m, "train/num_groups_short": 0}) is None
    said = watch.update(m)
    assert said.startswith("warning: step 3 reached algorithm.filter_groups.max_num_gen_batches=2")
    assert "trained on the 12 groups" in said and watch.update(m) is None
