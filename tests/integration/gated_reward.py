"""A verl-style reward file (`compute_score`) that lets a test hold a training step in flight for as long as it needs.

Exact match on the arithmetic task. When $MESHRL_TEST_GATE names a folder holding a file `hold` and no file `go`,
each call writes `held` there and waits until `go` appears: the step whose rewards are being computed stays in
flight, whatever the machine's load, until the test has done what it must do during that step.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    gate = os.environ.get("MESHRL_TEST_GATE")
    if gate and (Path(gate) / "hold").exists():
        (Path(gate) / "held").touch()
        while not (Path(gate) / "go").exists():
            time.sleep(0.02)
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0
