"""Issue 25 acceptance: every service process serves Prometheus metrics that move during a real run, each step is
one trace across the processes (generate, reward, reference, train, weight sync), `meshrl trace` prints it and
`meshrl watch --once` shows the run."""

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.cli import runs as cli_runs
from coordinator.cli.launcher import Launcher
from coordinator.client import Client

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def scrape(address: str) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of one /metrics endpoint."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict, name: str, **labels) -> float:
    """The sum over the samples of `name` whose labels include `labels` (0 when there are none)."""
    return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())


def metrics_address(child) -> str:
    found = re.search(rf"meshrl {child.role} metrics on (\S+)", child.log_path.read_text())
    assert found, f"{child.role}-{child.index} announced no metrics endpoint (log {child.log_path})"
    return found.group(1)


def _meshrl(*args):
    return subprocess.run([sys.executable, "-m", "coordinator.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"})


def test_metrics_move_and_each_step_is_one_trace_across_the_service_processes(arith_model_path, tmp_path):
    overrides = {"model.path": arith_model_path, "run.run_dir": str(tmp_path), "run.num_steps": "3",
                 "run.eval_every": "0", "data.heldout_size": "16", "data.rollout_batch_size": "8",
                 "server.metrics_port": "0"}
    raw, cfg = cli_runs._load_recipe(REPO / "examples/arith/grpo.yaml", {}, overrides)
    placement = {"reference": [""], "reward": [""], "rollout": ["", ""]}     # CPU: one process per replica
    with Launcher(str(REPO / "examples/arith/grpo.yaml"), log_dir=tmp_path / "logs", overrides=overrides) as launcher:
        addresses = cli_runs._start_mesh(launcher, cfg, raw, overrides, placement, "")
        endpoints = {f"{c.role}-{c.index}": metrics_address(c) for c in launcher.children}
        assert sorted(endpoints) == ["coordinator-0", "reference-0", "reward-0", "rollout-0", "rollout-1",
                                     "trainer-0"]
        with Client(addresses["coordinator"][0]) as client:
            run_id = client.start_run(cli_runs._with_addresses(raw, overrides, addresses))
            first = None
            for m in client.stream_metrics(run_id):
                if m["step"] == 1 and "reward_mean" in m and first is None:
                    first = {name: scrape(a) for name, a in endpoints.items()}      # during the run
            status = client.get_run(run_id)
            assert status.state == "COMPLETED", status.message
            last = {name: scrape(a) for name, a in endpoints.items()}
            watched = _meshrl("watch", run_id, "--once", "--coordinator", addresses["coordinator"][0])
            live = _meshrl("watch", run_id, "--coordinator", addresses["coordinator"][0])   # ends with the run
    _check_metrics(first, last, run_id)
    run_dir = Path(status.run_dir)
    _check_traces(run_dir / "traces.jsonl")
    printed = _meshrl("trace", run_id, "2", "--runs-dir", str(tmp_path))
    assert printed.returncode == 0, printed.stderr
    lines = printed.stdout.splitlines()
    assert lines[0].startswith("step 2 ")
    for name in ("generate", "rollout Generate", "reward Score", "reference ComputeLogProbs", "trainer TrainActor",
                 "trainer PushWeights", "rollout UpdateWeights"):
        assert any(name in line for line in lines), (name, printed.stdout)
    assert lines[-1].startswith("critical path: ") and sum("*" in line for line in lines[1:-1]) >= 1
    assert watched.returncode == 0, watched.stderr
    assert f"COMPLETED  step 3/3" in watched.stdout and "weight version 3" in watched.stdout
    assert "reward" in watched.stdout and "train" in watched.stdout and "last warning: none" in watched.stdout
    assert live.returncode == 0, live.stderr
    assert live.stdout.splitlines()[-1] == f"{run_id}: COMPLETED at step 3/3"


def _check_metrics(first: dict, last: dict, run_id: str) -> None:
    assert first is not None, "no step 1 in the metric stream"
    for name, samples in last.items():
        # every process counts the calls it served, each by method and status code
        role = name.split("-")[0]
        assert value(samples, "meshrl_rpc_requests_total", code="OK") > value(first[name],
                                                                              "meshrl_rpc_requests_total",
                                                                              code="OK") or role == "reference", name
        assert value(samples, "meshrl_rpc_duration_seconds_count") > 0, name
    for rollout in ("rollout-0", "rollout-1"):
        before, after = first[rollout], last[rollout]
        assert value(after, "meshrl_rpc_requests_total", method="Generate", code="OK") > \
            value(before, "meshrl_rpc_requests_total", method="Generate", code="OK")
        assert value(after, "meshrl_rollout_generated_tokens_total") > value(before, "meshrl_rollout_generated_tokens_total")
        assert value(before, "meshrl_rollout_weight_version") >= 1
        assert value(after, "meshrl_rollout_weight_version") == 3       # rising with every step's sync
        assert value(after, "meshrl_rollout_weight_update_timestamp_seconds") > 0
        assert value(after, "meshrl_rollout_weight_age_seconds") > 0
    trainer = last["trainer-0"]
    assert value(trainer, "meshrl_trainer_phase_seconds_count", phase="train") == 3
    assert value(first["trainer-0"], "meshrl_trainer_phase_seconds_count", phase="train") >= 1
    assert value(trainer, "meshrl_trainer_phase_seconds_count", phase="weight_sync") == 3
    assert value(trainer, "meshrl_trainer_trained_tokens_total") > 0
    assert value(trainer, "meshrl_trainer_weight_version") == 3
    assert value(last["reward-0"], "meshrl_rpc_requests_total", method="Score", code="OK") >= 3
    assert value(last["reference-0"], "meshrl_rpc_requests_total", method="ComputeLogProbs", code="OK") >= 3
    coordinator = last["coordinator-0"]
    assert value(first["coordinator-0"], "meshrl_coordinator_step", run_id=run_id) >= 1
    assert value(coordinator, "meshrl_coordinator_step", run_id=run_id) == 3
    assert value(coordinator, "meshrl_coordinator_run_state", run_id=run_id, state="COMPLETED") == 1
    assert value(coordinator, "meshrl_coordinator_run_state", run_id=run_id, state="RUNNING") == 0
    # step metrics carry the run (many runs share a coordinator: docs/many_runs.md)
    assert value(coordinator, "meshrl_coordinator_phase_seconds_count", run_id=run_id, phase="generate") == 3
    assert value(coordinator, "meshrl_coordinator_samples_total", run_id=run_id) == 3 * 8 * 8
    assert value(coordinator, "meshrl_coordinator_step_seconds_count", run_id=run_id) == 3
    assert 0.0 <= value(coordinator, "meshrl_coordinator_reward", run_id=run_id) <= 1.0
    assert ("meshrl_coordinator_reward", (("run_id", run_id),)) in coordinator


def _check_traces(path: Path) -> None:
    spans = [json.loads(line) for line in path.read_text().splitlines()]
    roots = [s for s in spans if s["parent_id"] is None]
    assert sorted(s["attributes"]["meshrl.step"] for s in roots) == [1, 2, 3]
    assert len({s["trace_id"] for s in spans}) == 3                     # one trace per step, nothing outside them
    for root in roots:
        mine = {s["span_id"]: s for s in spans if s["trace_id"] == root["trace_id"]}
        assert len(mine) == len([s for s in spans if s["trace_id"] == root["trace_id"]])    # no span twice
        # every span hangs under the root
        for s in mine.values():
            node = s
            while node["parent_id"] is not None:
                node = mine[node["parent_id"]]
            assert node is root, s["name"]
        phases = {s["name"] for s in mine.values() if s["parent_id"] == root["span_id"]}
        assert {"generate", "reward", "reference", "old_logprobs", "train", "weight_sync"} <= phases
        servers = [s for s in mine.values() if s["kind"] == "server"]
        assert {s["attributes"]["meshrl.role"] for s in servers} == {"rollout", "reward", "reference", "trainer"}
        # the trainer's push to both rollout processes sits under its PushWeights server span
        push = next(s for s in servers if s["name"] == "trainer PushWeights")
        calls = [s for s in mine.values() if s["parent_id"] == push["span_id"] and s["kind"] == "client"]
        pushed = [s for s in calls if s["name"].endswith("UpdateWeights")]
        # weight_sync.transport auto asks each replica where it is (GetInfo) before its first push only
        asked = sorted(s["name"] for s in calls if s not in pushed)
        assert asked == (["Rollout/GetInfo"] * 2 if root["attributes"]["meshrl.step"] == 1 else []), asked
        assert len(pushed) == 2 and all(
            any(c["parent_id"] == p["span_id"] and c["name"] == "rollout UpdateWeights" for c in servers)
            for p in pushed)
        # a child starts and ends within its parent (same host clock)
        for s in mine.values():
            if s["parent_id"] is not None:
                parent = mine[s["parent_id"]]
                assert parent["start_ns"] <= s["start_ns"] and s["end_ns"] <= parent["end_ns"], s["name"]
