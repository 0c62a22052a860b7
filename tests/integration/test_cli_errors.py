"""Errors as a `meshrl` user sees them: one line naming their key, exit 2 for bad input and 1 for a failure of
the system, `--debug` for the traceback; `meshrl up` starts nothing for a config that was going to fail."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from coordinator.cli.launcher import Launcher
from coordinator.client import Client

REPO = Path(__file__).resolve().parents[2]
GROUPS = ("rollout.n: algorithm.adv_estimator grpo compares the samples of each prompt and needs rollout.n >= 2, "
          "got 1 (one sample has no baseline and trains on nothing)")


def meshrl(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "coordinator.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


def recipe(tmp_path: Path, name: str, data: dict) -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory):
    """A coordinator process whose own config names one (unreachable) rollout replica as its default pool."""
    tmp = tmp_path_factory.mktemp("coordinator")
    config = recipe(tmp, "coordinator.yaml", {"rollout": {"servers": ["127.0.0.1:1"]}})
    with Launcher(config, log_dir=tmp / "logs") as launcher:
        yield launcher.wait_ready(launcher.start("coordinator"))


BROKEN_UP = {
    "missing model folder": ({"model": {"path": "/nonexistent/model"}, "rollout": {"n": 4}},
                             "model.path: '/nonexistent/model' is not a folder (a local Hugging Face model folder is "
                             "expected)"),
    "mesh that does not fit": ({"rollout": {"n": 4}, "actor": {"tp_size": 3}, "trainer": {"nproc_per_node": 2}},
                               "actor.tp_size * actor.pp_size * actor.dp_size = 3 * 1 * 1 = 3, but the trainer has 2 "
                               "rank(s) (trainer.nproc_per_node); no actor.dp_size fits: make trainer.nproc_per_node a "
                               "multiple of tp_size * pp_size = 3, or lower actor.tp_size / actor.pp_size"),
    "grpo with one sample": ({"rollout": {"n": 1}}, GROUPS),
    "lengths past the model": ({"rollout": {"n": 4, "max_tokens": 64}},
                               "rollout.max_tokens: 64 new tokens leave no room for a prompt within 64 tokens, the "
                               "model's max_position_embeddings (model.path 'examples/arith/model')"),
}


@pytest.mark.parametrize("case", BROKEN_UP)
def test_meshrl_up_refuses_a_broken_config_with_one_line_before_any_service_starts(tmp_path, case):
    data, line = BROKEN_UP[case]
    result = meshrl("up", recipe(tmp_path, "broken.yaml", data), "--run-dir", str(tmp_path / "runs"))
    assert (result.returncode, result.stderr, result.stdout) == (2, f"meshrl up: {line}\n", "")
    assert not (tmp_path / "runs").exists()  # no log folder: no service process was started


def test_meshrl_up_names_the_file_and_key_of_a_schema_error(tmp_path):
    path = recipe(tmp_path, "bad.yaml", {"rollout": {"n": 0}})
    result = meshrl("up", path)
    assert (result.returncode, result.stderr) == (2, f"meshrl up: {path}: rollout.n: Input should be greater than "
                                                     f"or equal to 1\n")


def test_meshrl_run_reports_the_config_error_before_connecting_to_a_coordinator(tmp_path):
    result = meshrl("run", recipe(tmp_path, "n1.yaml", {"rollout": {"n": 1}}), "--coordinator", "127.0.0.1:1")
    assert (result.returncode, result.stderr) == (2, f"meshrl run: {GROUPS}\n")


def test_meshrl_run_shows_an_invalid_argument_of_start_run_as_its_status_and_message(tmp_path, coordinator):
    # The model folder is checked by StartRun, on the coordinator's machine, where it is read.
    path = recipe(tmp_path, "missing.yaml", {"model": {"path": "/nonexistent/model"}, "rollout": {"n": 4}})
    result = meshrl("run", path, "--coordinator", coordinator)
    assert (result.returncode, result.stderr) == (
        2, "meshrl run: INVALID_ARGUMENT: model.path: '/nonexistent/model' is not a folder (a local Hugging Face "
           "model folder is expected)\n")


def test_debug_prints_the_traceback_before_the_line(tmp_path):
    result = meshrl("--debug", "run", recipe(tmp_path, "n1.yaml", {"rollout": {"n": 1}}))
    assert result.returncode == 2
    assert result.stderr.startswith("Traceback (most recent call last):\n")
    assert result.stderr.endswith(f"ValueError: {GROUPS}\nmeshrl run: {GROUPS}\n")


def test_an_unknown_run_id_is_not_found_and_exit_2(coordinator):
    for command in ("status", "services", "stop"):
        result = meshrl(command, "no-such-run", "--coordinator", coordinator)
        assert (result.returncode, result.stderr) == (2, f"meshrl {command}: NOT_FOUND: run_id: no run "
                                                         f"'no-such-run'\n")


def test_no_coordinator_is_a_failure_of_the_system_exit_1():
    result = meshrl("status", "--coordinator", "127.0.0.1:1")
    assert result.returncode == 1
    assert result.stderr.startswith("meshrl status: no coordinator at 127.0.0.1:1 (Connection refused); start a mesh "
                                    "with `meshrl mesh RECIPE`") and result.stderr.count("\n") == 1


def test_list_services_without_a_run_id_gives_the_coordinators_own_pools(coordinator):
    with Client(coordinator) as client:
        replicas = client.list_services()
    assert [(r.pool, r.address, r.healthy) for r in replicas] == [("rollout", "127.0.0.1:1", False)]


def test_a_trainer_that_fails_under_torchrun_is_reported_by_its_own_error_line(tmp_path):
    from coordinator.cli.launcher import ServiceFailed

    # A critic with a pipeline is refused by the trainer itself (no preflight here: the launcher alone).
    config = recipe(tmp_path, "run.yaml", {"actor": {"pp_size": 2}, "critic": {}})
    with Launcher(config, log_dir=tmp_path / "logs") as launcher:
        child = launcher.start("trainer", nproc=2)
        with pytest.raises(ServiceFailed) as err:
            launcher.wait_ready(child)
    assert str(err.value) == (f"trainer-0 exited with code 1 before serving: ValueError: critic: a critic with "
                              f"actor.pp_size > 1 is not implemented yet (log: {tmp_path / 'logs' / 'trainer-0.log'})")


def test_an_unexpected_error_is_one_line_with_its_type_and_exit_1(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import coordinator.cli.report
    from coordinator.cli import app

    def broken(*args, **kwargs):
        raise KeyError("reward_mean")

    monkeypatch.setattr(coordinator.cli.report, "plot_run", broken)
    result = CliRunner().invoke(app, ["plot", str(tmp_path)])
    assert (result.exit_code, result.output) == (1, "meshrl plot: KeyError: 'reward_mean' (--debug prints the "
                                                    "traceback)\n")
