"""bench/async_rl.py combine on hand-made run JSONs (the measured time-slicing bound, what bounds each goal), and
bench/e2e_grpo.py --placement."""

from __future__ import annotations

import json

import pytest

from bench import async_rl

PHASES = ("generate", "reward", "reference", "old_logprobs", "train", "weight_sync")


def write_run(folder, workload: str, mode: str, *, host: float = 0.05, steps: int = 4, **phases) -> float:
    """A run of `steps` equal steps (step 1 the warm-up, with no interval) whose interval is the phases' critical
    path plus `host`; returns that interval."""
    ph = {k: phases.get(k, 0.0) for k in PHASES}
    interval = (ph["generate"] + max(ph["reward"], ph["reference"], ph["old_logprobs"]) + ph["train"]
                + ph["weight_sync"] + host)
    rows = [{"step": i, "phases": ph, "interval_seconds": interval if i > 1 else None, "response_length_mean": 10.0}
            for i in range(1, steps + 1)]
    run = {"device": "cpu", "settings": {"warmup_steps": 1, "shape": "tiny-256", "prompts_per_step": 2, "n": 2},
           "seconds_per_step_median": interval, "interval_seconds_median": interval, "samples_per_s": 4 / interval,
           "mode": {"name": mode}, "workload": {"lengths": workload}, "steps": rows}
    (folder / f"{workload}-{mode}-r0.json").write_text(json.dumps(run))
    return interval


def combine(tmp_path) -> dict:
    out = tmp_path / "combined.json"
    async_rl.main(["combine", "--out-dir", str(tmp_path / "runs"), "--out", str(out)])
    return json.loads(out.read_text())


@pytest.fixture
def runs(tmp_path):
    folder = tmp_path / "runs"
    folder.mkdir()
    return folder


def test_time_slicing_growth_is_measured_against_sync_generate_and_bounds_the_fixed_goal(tmp_path, runs):
    sync = write_run(runs, "fixed", "sync", generate=1.0, reward=0.02, reference=0.3, train=1.0, weight_sync=0.05)
    # generation hidden, but reference grows by 0.4 s and train by 0.5 s: 90% of sync's generate time
    k1 = write_run(runs, "fixed", "k1", generate=0.01, reward=0.02, reference=0.7, train=1.5, weight_sync=0.05)
    result = combine(tmp_path)
    bound = result["workloads"]["fixed"]["measured_bounds"]["k1"]
    assert bound["non_generate_growth_s"]["score"] == pytest.approx(0.4)
    assert bound["non_generate_growth_s"]["train"] == pytest.approx(0.5)
    assert bound["non_generate_growth_s"]["host"] == pytest.approx(0.0)
    ts = bound["time_slicing"]
    assert ts["share_of_sync_generate"] == pytest.approx(0.9)
    assert ts["implied_step_s"] == pytest.approx(sync - 1.0 + 0.9)
    assert bound["step_s"] == pytest.approx(k1)
    goal = result["goals"]["fixed_async_at_least_1.05x_sync"]
    assert goal["speedup"] == pytest.approx(sync / k1) and goal["speedup"] < 1.05
    assert not goal["met"] and goal["bound"] == "time_slicing" and "90%" in goal["reason"]


def test_a_weight_sync_waiting_for_the_generation_in_flight_is_the_tail(tmp_path, runs):
    write_run(runs, "longtail", "sync", generate=3.0, reference=0.2, train=0.7, weight_sync=0.05)
    write_run(runs, "longtail", "k1", generate=0.01, reference=0.3, train=0.8, weight_sync=2.0)
    write_run(runs, "longtail", "k2", generate=0.5, reference=0.2, train=0.7, weight_sync=0.05, host=2.0)
    result = combine(tmp_path)
    bounds = result["workloads"]["longtail"]["measured_bounds"]
    assert bounds["k1"]["excess_s"]["tail"] == pytest.approx(0.01 + 1.95)
    assert bounds["k2"]["excess_s"]["host_phases"] == pytest.approx(1.95)
    goal = result["goals"]["longtail_async_at_least_1.3x_sync"]
    assert not goal["met"] and goal["best_mode"] == "k1" and goal["bound"] == "tail"


def test_host_phases_bound_and_a_met_goal_carries_no_bound(tmp_path, runs):
    write_run(runs, "fixed", "sync", generate=1.0, reference=0.3, train=1.0, weight_sync=0.05)
    write_run(runs, "fixed", "k1", generate=0.01, reference=0.3, train=1.0, weight_sync=0.05, host=1.0)
    write_run(runs, "longtail", "sync", generate=3.0, reference=0.2, train=0.7, weight_sync=0.05)
    write_run(runs, "longtail", "k2", generate=1.9, reference=0.25, train=0.75, weight_sync=0.05)   # 1.33x
    goals = combine(tmp_path)["goals"]
    fixed = goals["fixed_async_at_least_1.05x_sync"]
    assert not fixed["met"] and fixed["bound"] == "host_phases"
    longtail = goals["longtail_async_at_least_1.3x_sync"]
    assert longtail["met"] and "bound" not in longtail


def test_a_goal_out_of_reach_of_a_fully_hidden_generation_names_the_longer_side(tmp_path, runs):
    # sync: generate 4 s of a 5 s step: hiding it all reaches 5 / 4 = 1.25x < 1.3x, whatever async does
    write_run(runs, "longtail", "sync", generate=4.0, reference=0.2, train=0.7, weight_sync=0.05)
    write_run(runs, "longtail", "k2", generate=3.0, reference=0.2, train=0.7, weight_sync=0.05)
    goal = combine(tmp_path)["goals"]["longtail_async_at_least_1.3x_sync"]
    assert not goal["met"] and goal["bound"] == "tail" and "1.25x < 1.3x" in goal["reason"]


def test_the_split_placement_puts_the_rollout_on_the_second_visible_gpu(monkeypatch, tmp_path):
    from bench import e2e_grpo

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert e2e_grpo.placement_devices("split") == {"trainer": "0", "reference": "0", "reward": "0", "rollout": "1"}
    assert e2e_grpo.placement_devices("shared") == {}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert e2e_grpo.placement_devices("split")["rollout"] == "6"
    assert e2e_grpo.placement_devices("split")["trainer"] == "4"
    with pytest.raises(SystemExit, match="--placement split: needs --device cuda"):
        e2e_grpo.main(["run", "--placement", "split", "--out", str(tmp_path / "x.json")])
