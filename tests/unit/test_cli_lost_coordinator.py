"""`meshrl run` that loses its coordinator while it follows the run (the coordinator killed, or its mesh stopped with a
killed trainer) ends with one line naming the run and how to find it again, exit 1; not grpc's own words
(`UNAVAILABLE: Stream removed (Socket closed)`, `UNAVAILABLE: Cancelling all calls`) nor `no coordinator at ...;
start a mesh` for a coordinator it reached and started the run on (found by `kill -9` of the coordinator and of the
trainer of `meshrl mesh examples/arith/grpo.yaml` under a `meshrl run`)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from typer.testing import CliRunner

from coordinator.cli import app
from coordinator.cli.common import Connection

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "arith" / "grpo.yaml"


class _Lost(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


class _Client:
    """A coordinator that starts the run, streams two steps, then goes away with `error`."""

    def __init__(self, error: Exception):
        self.error = error

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def start_run(self, text):
        return "arith-grpo-r1"

    def get_run(self, run_id):
        return SimpleNamespace(num_steps=30)

    def stream_metrics(self, run_id, from_step=0):
        for step in (1, 2):
            yield {"step": step, "reward_mean": 0.5, "kl": 0.0, "samples_per_s": 10.0}
        raise self.error


def _run(monkeypatch, error: Exception):
    monkeypatch.setattr(Connection, "client", lambda self: _Client(error))
    result = CliRunner().invoke(app, ["run", str(RECIPE), "--coordinator", "127.0.0.1:9", "--run.num_steps", "30"])
    return result.exit_code, " ".join(result.output.split())


@pytest.mark.parametrize("details", ["Stream removed (Socket closed)", "Cancelling all calls",
                                     "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:9: "
                                     "Failed to connect to remote host: Connection refused"])
def test_a_coordinator_lost_while_following_names_the_run_and_how_to_find_it_again(monkeypatch, details):
    code, out = _run(monkeypatch, _Lost(grpc.StatusCode.UNAVAILABLE, details))
    assert code == 1, out
    assert "step 2/30" in out
    assert f"meshrl run: lost the coordinator at 127.0.0.1:9 while following run arith-grpo-r1 ({details})" in out
    assert "meshrl resume arith-grpo-r1" in out and "run.redis_url" in out
    assert "no coordinator at" not in out and "start a mesh with" not in out


def test_any_other_error_while_following_keeps_its_own_words(monkeypatch):
    code, out = _run(monkeypatch, _Lost(grpc.StatusCode.NOT_FOUND, "run 'arith-grpo-r1' not found"))
    assert code == 2 and "meshrl run: NOT_FOUND: run 'arith-grpo-r1' not found" in out, out
    assert "lost the coordinator" not in out
