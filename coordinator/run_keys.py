"""Where a run's record lives in Redis and which of its states have steps left: the run store writes there
(coordinator/runapi/store.py) and `meshrl up --resume` reads it before the mesh starts (coordinator/cli/interrupt.py)."""

from __future__ import annotations

UNFINISHED = ("PENDING", "RUNNING", "PAUSED")


def redis_key(prefix: str, *parts: str) -> str:
    """`prefix:part:...`: a run's record is redis_key(prefix, "run", run_id), the set of run ids redis_key(prefix,
    "runs")."""
    return ":".join((prefix, *parts))
