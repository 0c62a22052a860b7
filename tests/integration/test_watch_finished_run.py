"""`meshrl watch RUN_ID` of a run that has ended shows the run's whole metric stream: the held-out accuracy after
training (the last record, `final: 1`, at the same step as the last training step) as well as before, not a frame
drawn as soon as the last step's number came in."""

import io

from rich.console import Console

from coordinator.cli.watch import watch_run
from coordinator.client import Client
from coordinator.runapi.store import RunRecord
from tests.integration.stored_coordinator import StoredCoordinator

RUN = "arith-grpo-done"
METRICS = [{"step": 0, "heldout_accuracy": 0.325},
           *({"step": s, "reward_mean": 0.5, "accuracy": 0.5, "time/step": 0.4, "time/train": 0.2} for s in (1, 2, 3)),
           {"step": 3, "heldout_accuracy": 0.39, "final": 1.0}]


def served():
    return StoredCoordinator([RunRecord(run_id=RUN, config="", state="COMPLETED", step=3, num_steps=3,
                                        weight_version=3, last_metrics={"reward_mean": 0.5})], {RUN: METRICS})


def test_watch_once_of_a_finished_run_shows_the_heldout_accuracy_after_training():
    with served() as address:
        for _ in range(3):          # each view drawn from the whole stream, every time
            out = io.StringIO()
            with Client(address) as client:
                watch_run(client, RUN, once=True, console=Console(file=out, width=120))
            held = next(line for line in out.getvalue().splitlines() if line.startswith("held-out"))
            assert held.split()[:2] == ["held-out", "0.390"], out.getvalue()


def test_the_live_watch_of_a_finished_run_ends_on_the_frame_with_the_heldout_accuracy_after():
    with served() as address:
        out = io.StringIO()
        with Client(address) as client:
            watch_run(client, RUN, console=Console(file=out, width=120))
        lines = out.getvalue().splitlines()
        held = [line for line in lines if line.startswith("held-out")]
        assert held and held[-1].split()[:2] == ["held-out", "0.390"], out.getvalue()
        assert lines[-1] == f"{RUN}: COMPLETED at step 3/3"
