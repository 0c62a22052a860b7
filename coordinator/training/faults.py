"""Fault injection for the reliability tests, read in this one place: `MESHRL_TEST_KILL_AT=POINT:stepN` makes the
coordinator kill itself with SIGKILL when step N reaches POINT (after_generate, after_train, after_sync,
after_commit). Unset, as everywhere but those tests, every point is a no-op."""

from __future__ import annotations

import logging
import os
import re
import signal

log = logging.getLogger("meshrl.coordinator")

KILL_POINTS = ("after_generate", "after_train", "after_sync", "after_commit")
ENV = "MESHRL_TEST_KILL_AT"


def _parse(text: str) -> tuple[str, int] | None:
    if not text:
        return None
    m = re.fullmatch(r"(\w+):step(\d+)", text.strip())
    if m is None or m.group(1) not in KILL_POINTS:
        raise ValueError(f"{ENV}: expected POINT:stepN with POINT one of {', '.join(KILL_POINTS)}, got {text!r}")
    return m.group(1), int(m.group(2))


_KILL_AT = _parse(os.environ.get(ENV, ""))


def kill_point(point: str, step: int) -> None:
    """SIGKILL this process when (point, step) is the configured one: nothing after it runs, as in a crash."""
    assert point in KILL_POINTS, point
    if _KILL_AT == (point, step):
        log.warning("%s: killing the coordinator at %s of step %d", ENV, point, step)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)
