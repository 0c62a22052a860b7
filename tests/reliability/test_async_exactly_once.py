"""Exactly-once steps with two batches in flight (run.async_mode, max_staleness 2): a coordinator killed at any
point of a step resumes from the async ledger: the generated groups in flight are reloaded, the others generated
again at their data positions; no step is missing, repeated or trained twice and no prompt group is trained twice
or lost (the trainer's audit lines, the store, metrics.jsonl and the ledger's settled log agree)."""

import uuid

import pytest

from coordinator.training.faults import KILL_POINTS
from tests.reliability.procs import LEDGER_OK, kill_at_each_point, ledger_report, run_config
from tests.reliability.test_exactly_once_steps import BATCH, KILL_STEP, NUM_STEPS, _applied, _count, _report


@pytest.mark.slow
@pytest.mark.redis
def test_a_coordinator_killed_with_two_batches_in_flight_trains_every_step_and_prompt_exactly_once(
        arith_model_path, tmp_path, redis_url, monkeypatch):
    cfg = run_config(arith_model_path, tmp_path / "runs", run={"num_steps": NUM_STEPS, "checkpoint_every": 3,
                                                               "async_mode": True, "max_staleness": 2})
    reports, prefix = {}, f"meshrl-ledger-{uuid.uuid4().hex[:8]}"
    restarts = {}

    def check(point, final, records, trainer_log, jsonl):
        assert (final.step, final.data_position) == (NUM_STEPS, NUM_STEPS * BATCH), point
        reports[point] = _report(point, records, _applied(trainer_log, final.run_id))
        assert _count(jsonl) == {"missing": 0, "repeated": 0}, point
        # The bound holds across the restart: no trained step took samples more than 2 versions behind.
        assert all(0 <= m["staleness_max"] <= 2 for m in jsonl if "reward_mean" in m), point
        assert ledger_report(redis_url, prefix, final.run_id, NUM_STEPS, BATCH) == LEDGER_OK, point
        # The first step the restarted coordinator trained reports what it took back from the ledger.
        first = next(m for m in jsonl if "reward_mean" in m and m["step"] > KILL_STEP - 1 and not m.get("recovered")
                     and m.get("async/groups_recovered", 0) + m.get("async/groups_regenerated", 0) > 0)
        restarts[point] = (int(first["async/groups_recovered"]), int(first["async/groups_regenerated"]))

    kill_at_each_point(cfg, tmp_path, redis_url, monkeypatch, KILL_STEP, check, prefix=prefix)
    print("\nrestart counts (groups recovered, regenerated) by kill point:", restarts)
    # Killed after step 3's batch was generated, before its update: that batch (4 groups) is reloaded, not made again.
    assert restarts["after_generate"][0] >= BATCH
    assert all(sum(r) >= BATCH for r in restarts.values())
    zero = {"missing": 0, "repeated": 0, "trained_twice": 0, "prompts_twice": 0, "prompts_skipped": 0}
    assert reports == {point: zero for point in KILL_POINTS}
