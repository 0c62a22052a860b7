"""What `meshrl stop RUN_ID` prints: a running run stops after its current step, so the line says so (as
`meshrl pause` does), not the bare state `RUNNING` the run still has when the command returns."""

from typer.testing import CliRunner

from coordinator.runapi.store import RunRecord
from tests.integration.stored_coordinator import StoredCoordinator


def invoke(*args):
    from coordinator.cli import app

    return CliRunner().invoke(app, list(args), env={"COLUMNS": "80"})


def test_stop_of_a_running_run_says_it_stops_after_its_current_step():
    # A RUNNING record: the coordinator records the command; the run's loop reads it after the step in flight.
    with StoredCoordinator([RunRecord(run_id="r1", config="", state="RUNNING", step=5, num_steps=80)]) as address:
        result = invoke("stop", "r1", "--coordinator", address)
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "run r1 stops after its current step (steps done: 5/80)\n"


def test_stop_of_a_paused_run_says_it_stopped():
    with StoredCoordinator([RunRecord(run_id="r2", config="", state="PAUSED", step=3, num_steps=80)]) as address:
        result = invoke("stop", "r2", "--coordinator", address)
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "run r2 STOPPED at step 3/80\n"
