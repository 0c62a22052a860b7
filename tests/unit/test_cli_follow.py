"""`meshrl up` prints a line for every held-out evaluation, including those that arrive inside a step's record."""
import io

from rich.console import Console

from coordinator.cli import runs as cli_runs


class _Client:
    def __init__(self, records):
        self.records = records

    def stream_metrics(self, run_id, from_step=0):
        return iter(self.records)


def test_a_mid_run_evaluation_in_a_step_record_gets_its_own_line(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(cli_runs, "console", Console(file=out, width=200, force_terminal=False))
    records = [{"step": 0, "heldout_accuracy": 0.25},
               {"step": 1, "reward_mean": 0.5, "kl": 0.0, "samples_per_s": 10.0},
               {"step": 2, "reward_mean": 0.6, "kl": 0.0, "samples_per_s": 10.0, "heldout_accuracy": 0.5},
               {"step": 2, "heldout_accuracy": 0.75, "final": True}]
    cli_runs._follow(_Client(records), "run", 2, warn_steps=3)
    text = out.getvalue()
    assert "held-out accuracy before: 25.0%" in text
    assert "held-out accuracy at step 2: 50.0%" in text
    assert "held-out accuracy after: 75.0%" in text
