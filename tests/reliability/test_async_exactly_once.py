"""Exactly-once steps with two batches in flight (run.async_mode, max_staleness 2): a coordinator killed at any
point of a step loses its in-flight batches, which the restarted one generates again at their data positions;
no step is missing, repeated or trained twice and no prompt is used twice or skipped."""

import pytest

from coordinator.training.faults import KILL_POINTS
from tests.reliability.procs import kill_at_each_point, run_config
from tests.reliability.test_exactly_once_steps import BATCH, KILL_STEP, NUM_STEPS, _applied, _count, _report


@pytest.mark.slow
@pytest.mark.redis
def test_a_coordinator_killed_with_two_batches_in_flight_trains_every_step_and_prompt_exactly_once(
        arith_model_path, tmp_path, redis_url, monkeypatch):
    cfg = run_config(arith_model_path, tmp_path / "runs", run={"num_steps": NUM_STEPS, "checkpoint_every": 3,
                                                               "async_mode": True, "max_staleness": 2})
    reports = {}

    def check(point, final, records, trainer_log, jsonl):
        assert (final.step, final.data_position) == (NUM_STEPS, NUM_STEPS * BATCH), point
        reports[point] = _report(point, records, _applied(trainer_log, final.run_id))
        assert _count(jsonl) == {"missing": 0, "repeated": 0}, point
        # The bound holds across the restart: no trained step took samples more than 2 versions behind.
        assert all(0 <= m["staleness_max"] <= 2 for m in jsonl if "reward_mean" in m), point

    kill_at_each_point(cfg, tmp_path, redis_url, monkeypatch, KILL_STEP, check)
    zero = {"missing": 0, "repeated": 0, "trained_twice": 0, "prompts_twice": 0, "prompts_skipped": 0}
    assert reports == {point: zero for point in KILL_POINTS}
