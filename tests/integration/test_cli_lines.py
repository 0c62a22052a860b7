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


class _Mesh(_Client):
    """A coordinator whose runs advance one step per ListRuns: `meshrl watch` follows them until all ended."""

    def list_runs(self):
        now = [RunStatus(r.run_id, r.state, r.step, r.num_steps, r.weight_version, 0, "", r.message, "",
                         dict(r.last_metrics), adapter=r.adapter) for r in self.runs]
        for r in self.runs:
            if r.state == "RUNNING":
                r.step += 1
                r.last_metrics = {"reward_mean": r.step / r.num_steps, "accuracy": 0.5}
                r.state = "COMPLETED" if r.step == r.num_steps else "RUNNING"
        return now


def mesh_runs():
    long_id = "gsm8k-qwen2.5-0.5b-grpo-lora-" + "x" * 30 + "-20260101-120000"
    return long_id, [RunStatus("done", "COMPLETED", 2, 2, 2, 0, "", "", "", {"reward_mean": 1.0}),
                     RunStatus(long_id, "RUNNING", 1, 3, 1, 0, "", "", "", {"reward_mean": 0.25, "accuracy": 0.5},
                               adapter="gsm8k-lora-2"),
                     RunStatus("paused", "PAUSED", 7, 10, 7, 0, "", "trainer unavailable", "", {})]


def test_watch_with_no_run_id_shows_every_run_on_the_mesh_active_first(monkeypatch):
    long_id, runs = mesh_runs()
    monkeypatch.setattr(common.Connection, "client", lambda self: _Client(runs))
    result = invoke("watch", "--once")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "3 runs on the mesh  1 running, 1 paused, 1 finished"
    assert lines[1].split()[:4] == ["run", "adapter", "state", "step"]
    assert [line.split()[:6] for line in lines[2:5]] == [
        [long_id, "gsm8k-lora-2", "RUNNING", "1/3", "1", "0.250"], ["paused", "-", "PAUSED", "7/10", "7", "-"],
        ["done", "-", "COMPLETED", "2/2", "2", "1.000"]]         # whole run ids at 80 columns, active runs first
    assert lines[2].split()[6] == "0.500" and lines[3].endswith("trainer unavailable")


def test_live_watch_of_the_mesh_follows_every_run_to_its_end(monkeypatch):
    long_id, runs = mesh_runs()
    runs.pop()                                    # a paused run would keep the view open
    monkeypatch.setattr(common.Connection, "client", lambda self: _Mesh(runs))
    monkeypatch.setattr("coordinator.cli.watch.time.sleep", lambda s: None)
    result = invoke("watch", COLUMNS="200")       # the live view is cut at the terminal's width
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines()[-1] == f"all 2 runs ended: done COMPLETED, {long_id} COMPLETED"
    frame = result.stdout.splitlines()[-4:-1]     # the last frame: the run's reward curve over the steps watched
    assert frame[2].split()[:7] == [long_id, "gsm8k-lora-2", "COMPLETED", "3/3", "1", "1.000", "0.500"], frame
    assert frame[2].split()[7] == "▁▅█"           # reward 0.25 (step 1), 0.67, 1.0: one point per step


def test_watch_of_an_empty_mesh_says_how_to_start_a_run(monkeypatch):
    monkeypatch.setattr(common.Connection, "client", lambda self: _Client([]))
    result = invoke("watch", "--once", "--coordinator", "127.0.0.1:7")
    assert (result.exit_code, result.stdout) == (0, "no runs on the coordinator at 127.0.0.1:7; `meshrl run RECIPE` "
                                                    "starts one\n")


def test_run_help_says_a_recipe_without_servers_runs_on_the_meshs_replicas():
    out = " ".join(invoke("run", "--help").stdout.split())
    assert "services listed in the YAML" not in out and "else on the mesh's replicas" in out, out


def test_the_training_api_example_help_ends_its_description_with_a_whole_sentence():
    out = subprocess.run([sys.executable, str(REPO / "examples/training_api/grpo_loop.py"), "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    description = " ".join(out.stdout.split("options:")[0].split("\n\n", 1)[1].split())
    assert description.endswith("Held-out greedy accuracy before and after."), description
