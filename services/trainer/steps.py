"""The trainer's record of the last run step it applied: what makes a training update exactly-once.

The coordinator names each update by its run step (run id, step, data position after it). The trainer keeps
the last one with the update's metrics, on rank 0, and reports it (GetInfo details `run_id`, `run_step`,
`run_data_position`), so a coordinator that restarts can tell a step the trainer applied but the run store
never recorded from one that never reached the trainer, and record that step with the metrics kept here
(GetInfo details `run_step_metrics`: the update's own and those the coordinator sent with it). A repeat of the
last step is answered from the record without training again; any other step of the same run but the next is
refused. A restarted trainer has no record; LoadCheckpoint sets it to the step whose weights the checkpoint holds.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from services.common.errors import FailedPrecondition
from services.trainer.types import RunStep

log = logging.getLogger("meshrl.trainer")


class StepRecord:
    """The last applied run step and its metrics; one update at a time goes through `apply`."""

    def __init__(self, model: str = "actor"):
        # The actor's record is the trainer's (GetInfo); the critic's only makes TrainCritic exactly-once.
        self.model = model
        self.last: RunStep | None = None
        self._metrics: dict[str, float] = {}
        # The weight version the last update made: the record's metrics are that version's.
        self._version = 0
        # Re-entrant: a checkpoint load holds it (hold) while it sets the record (restored).
        self._lock = threading.RLock()

    def apply(self, run_step: RunStep | None, update: Callable[[], dict[str, float]],
              weight_version: Callable[[], int]) -> tuple[dict[str, float], bool]:
        """Runs `update` unless `run_step` repeats the last applied step; -> (metrics, repeated)."""
        with self._lock:
            if run_step is not None and self._repeats(run_step):
                log.warning("run %s step %d: %s update already applied; answered from the record, not trained "
                            "again", run_step.run_id, run_step.step, self.model)
                return dict(self._metrics), True
            metrics = update()
            if run_step is not None:
                self.last, self._metrics, self._version = run_step, dict(metrics), weight_version()
                self._audit(run_step, self._version)
            return metrics, False

    def _audit(self, run_step: RunStep, weight_version: int) -> None:
        """One line per applied update: the trail of which run step made which weight version."""
        if self.model == "actor":
            log.info("applied run %s step %d (data position %d) as weight version %d", run_step.run_id,
                     run_step.step, run_step.data_position, weight_version)
        else:
            log.info("applied %s update of run %s step %d", self.model, run_step.run_id, run_step.step)

    def _repeats(self, run_step: RunStep) -> bool:
        last = self.last
        if last is None or last.run_id != run_step.run_id:
            return False
        if run_step == last:
            return True
        if run_step.step != last.step + 1:
            raise FailedPrecondition(f"run_step.step: run {run_step.run_id!r} step {run_step.step} does not follow "
                                     f"the step this trainer last applied ({last.step}); the run must resume from "
                                     f"a checkpoint")
        return False

    def hold(self) -> threading.RLock:
        """`with record.hold():` no update is applied or recorded meanwhile (checkpoint save and load)."""
        return self._lock

    def restored(self, run_step: RunStep | None) -> None:
        """After a checkpoint load: the weights are `run_step`'s (None: no run step is known)."""
        with self._lock:
            self.last, self._metrics, self._version = run_step, {}, 0

    def metrics_of(self, run_step: RunStep | None) -> dict[str, float] | None:
        """The update metrics of `run_step` when it is the last one applied (None: another step, or none kept)."""
        with self._lock:
            if run_step is None or self.last != run_step or not self._metrics:
                return None
            return dict(self._metrics)

    def applied(self) -> dict:
        """The last applied step's metrics, keyed by the weight version it made: {} when none are kept (no update
        of a run yet, or the record came from a checkpoint)."""
        with self._lock:
            if self.last is None or not self._metrics:
                return {}
            return {"run_id": self.last.run_id, "step": self.last.step, "weight_version": self._version,
                    "coordinator": dict(self.last.metrics), "update": dict(self._metrics)}

    def details(self) -> dict:
        last = self.last
        if last is None:
            return {"run_id": "", "run_step": 0, "run_data_position": 0}
        return {"run_id": last.run_id, "run_step": last.step, "run_data_position": last.data_position}
