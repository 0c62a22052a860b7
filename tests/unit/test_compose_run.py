"""deploy/compose_run.py, the compose `run` service: one run per id, followed across coordinator restarts."""

import importlib.util
from pathlib import Path

import grpc
import pytest

from coordinator.client import RunStatus

DRIVER = Path(__file__).resolve().parents[2] / "deploy" / "compose_run.py"
SPEC = importlib.util.spec_from_file_location("compose_run", DRIVER)
compose_run = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(compose_run)


class Error(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code


class FakeCoordinator:
    """A coordinator that knows `runs`, and fails the first `outages` calls with UNAVAILABLE (a restart)."""

    def __init__(self, runs=None, outages=0):
        self.runs, self.outages, self.started = dict(runs or {}), outages, []

    def _status(self, run_id, state, step):
        return RunStatus(run_id, state, step, 3, step, 0, "", "", f"runs/{run_id}")

    def get_run(self, run_id):
        if self.outages:
            self.outages -= 1
            raise Error(grpc.StatusCode.UNAVAILABLE)
        if run_id not in self.runs:
            raise Error(grpc.StatusCode.NOT_FOUND)
        return self._status(run_id, *self.runs[run_id])

    def start_run(self, recipe, run_id=""):
        self.started.append((run_id, recipe))
        self.runs[run_id] = ("RUNNING", 0)

    def stream_metrics(self, run_id, from_step=0):
        for step in range(max(from_step, 1), 4):
            yield {"step": step, "reward_mean": 0.5, "num_samples": 128}
        self.runs[run_id] = ("COMPLETED", 3)


def test_the_recipe_is_started_once_under_its_id_and_followed_to_its_end():
    coordinator = FakeCoordinator()
    status = compose_run.follow(coordinator, "compose", "run: {}", wait_s=10)
    assert status.state == "COMPLETED" and coordinator.started == [("compose", "run: {}")]


def test_a_known_run_is_followed_not_started_again(monkeypatch):
    monkeypatch.setattr(compose_run.time, "sleep", lambda s: None)
    coordinator = FakeCoordinator(runs={"compose": ("RUNNING", 2)}, outages=2)
    assert compose_run.follow(coordinator, "compose", "run: {}", wait_s=10).state == "COMPLETED"
    assert coordinator.started == []


def test_a_coordinator_that_stays_away_ends_the_driver_with_its_error(monkeypatch):
    monkeypatch.setattr(compose_run.time, "sleep", lambda s: None)
    coordinator = FakeCoordinator(outages=10**6)
    with pytest.raises(grpc.RpcError):
        compose_run.follow(coordinator, "compose", "run: {}", wait_s=0)
