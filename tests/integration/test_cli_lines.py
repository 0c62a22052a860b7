"""What `meshrl` prints, as a user meets it: click's usage errors as one line like every other error, help
printed as written, `meshrl status` with whole run ids at any terminal width, and a missing coordinator named in
one line with how to start one."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coordinator.cli import common, manage
from coordinator.client import RunStatus

REPO = Path(__file__).resolve().parents[2]
NO_COORDINATOR = ("no coordinator at 127.0.0.1:1 (Connection refused); start a mesh with `meshrl mesh RECIPE` or "
                  "`meshrl up RECIPE` (README), or name the coordinator with --coordinator HOST:PORT or MESHRL_COORDINATOR "
                  "(the address: --coordinator)")


def invoke(*args, **env):
    from coordinator.cli import app

    return CliRunner().invoke(app, list(args), env={"COLUMNS": "80", **env})


USAGE_ERRORS = {
    "missing argument": (("stop",), "meshrl stop: missing argument 'run_id' (`meshrl stop --help`)"),
    "unknown option": (("status", "--bogus"), "meshrl status: no such option: --bogus (`meshrl status --help`)"),
    "bad value": (("up", "examples/arith/grpo.yaml", "--threads", "x"),
                  "meshrl up: invalid value for '--threads': Input should be a valid integer, unable to parse string "
                  "as an integer (`meshrl up --help`)"),
    "unknown command": (("nosuch",), "meshrl: no such command 'nosuch' (`meshrl --help`)"),
    "unknown role": (("serve", "nosuch"), "meshrl serve: invalid value for ROLE: unknown role 'nosuch'; expected one "
                                          "of coordinator, trainer, reference, reward, env, rollout, training "
                                          "(`meshrl serve --help`)"),
    "no run directory": (("plot", "runs/nosuch"), "meshrl plot: runs/nosuch: no such run directory"),
}


@pytest.mark.parametrize("case", USAGE_ERRORS)
def test_a_usage_error_is_one_line_naming_the_command_and_exit_2(case):
    args, line = USAGE_ERRORS[case]
    result = invoke(*args)
    assert (result.exit_code, result.stdout, result.stderr) == (2, "", line + "\n")


def meshrl(*args):
    return subprocess.run([sys.executable, "-m", "coordinator.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "COLUMNS": "80"})


def test_the_installed_command_prints_the_same_one_line_with_no_box():
    result = meshrl("plot", "runs/nosuch")
    assert (result.returncode, result.stdout, result.stderr) == (2, "", "meshrl plot: runs/nosuch: no such run "
                                                                        "directory\n")


def test_help_is_printed_as_written():
    result = meshrl("up", "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())        # click re-flows the paragraph
    assert "`data.train_files=[a.parquet] actor_rollout_ref.rollout.n=8`" in text
    assert result.stdout.startswith("Usage: meshrl up ") and "╭" not in result.stdout


@pytest.mark.parametrize("args", [("status",), ("services",), ("watch", "r1", "--once"), ("stop", "r1"),
                                  ("pause", "r1"), ("resume", "r1")])
def test_with_no_coordinator_every_command_names_the_address_and_how_to_start_one(args):
    result = invoke(*args, "--coordinator", "127.0.0.1:1")
    assert (result.exit_code, result.stderr) == (1, f"meshrl {args[0]}: {NO_COORDINATOR}\n")


class _Client:
    def __init__(self, runs):
        self.runs = runs

    def list_runs(self):
        return self.runs

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def test_status_prints_whole_run_ids_at_80_columns(monkeypatch):
    long_id = "gsm8k-qwen2.5-0.5b-grpo-rollout-n16-temperature-1.0-" + "x" * 40 + "-20260101-120000-abcdef"
    runs = [RunStatus(long_id, "RUNNING", 3, 100, 3, 48, "", "", "runs/x", {"reward_mean": 0.25},
                      adapter="gsm8k-lora-2"),
            RunStatus("short", "PAUSED", 7, 10, 7, 112, "", "trainer 127.0.0.1:5 unavailable; restart the trainer, "
                      "then ResumeRun", "runs/y", {})]
    monkeypatch.setattr(common.Connection, "client", lambda self: _Client(runs))
    result = invoke("status")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["run", "state", "step", "weight", "version", "data", "position", "reward", "adapter",
                                "message"]
    assert lines[1].split()[:7] == [long_id, "RUNNING", "3/100", "3", "48", "0.250", "gsm8k-lora-2"]
    assert lines[2].split()[6] == "-"           # the trainer's run adapter (or a full-parameter run)
    assert lines[2].endswith("trainer 127.0.0.1:5 unavailable; restart the trainer, then ResumeRun")
    # The columns line up: each row's state starts where the header's does.
    assert {line.index(word) for line, word in zip(lines, ("state", "RUNNING", "PAUSED"))} == {len(long_id) + 2}


def test_columns_pad_to_the_widest_cell_and_cut_nothing():
    assert manage.columns(("a", "bb"), [("xxxx", "y"), ("z", "")]) == ["a     bb", "xxxx  y", "z"]
