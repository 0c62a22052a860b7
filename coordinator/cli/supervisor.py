"""`meshrl up`'s watch over its children during a run: a replica that dies is restarted (bounded tries, back-off)
while the coordinator's pools fail over; the coordinator, the trainer or every replica of a role lost ends it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from coordinator.cli.launcher import REPLICATED, Child, Launcher, ServiceFailed, failure


@dataclass(frozen=True)
class RestartPolicy:
    """How hard `meshrl up` tries to keep a replica alive."""

    max_restarts: int = 3          # restarts in a row before the replica is given up
    backoff_s: float = 1.0         # wait before the first restart, doubled for each next one
    max_backoff_s: float = 30.0
    ready_timeout_s: float = 180.0  # a restart that has not announced its address by then counts as failed
    # A restarted replica that has served this long gets its tries back: restarts are counted in a row, so a
    # replica that crashes once a day over a long run is not given up on the fourth day.
    stable_s: float = 300.0


@dataclass
class _Slot:
    """One replica's place in the mesh: its port, its current process, and its restarts so far."""

    child: Child
    port: int
    restarts: int = 0            # in a row
    total: int = 0               # over the run, names the restart's log file
    due: float | None = None     # when the next try starts (None: a process is running or starting)
    started: float = 0.0
    serving_since: float | None = 0.0
    last_failure: str = ""
    given_up: bool = False


class Supervisor:
    """Called from the main thread once a second or so (children must be forked there: see _die_with_parent)."""

    def __init__(self, launcher: Launcher, say: Callable[[str], None], policy: RestartPolicy = RestartPolicy(),
                 clock: Callable[[], float] = time.monotonic):
        self.launcher, self.say, self.policy, self.clock = launcher, say, policy, clock
        self.slots = [_Slot(c, int(c.address.rsplit(":", 1)[1])) for c in launcher.children
                      if c.role in REPLICATED]
        self.fixed = [c for c in launcher.children if c.role not in REPLICATED]

    def check(self) -> None:
        """One look at every child; ServiceFailed (one line with the cause) when the run cannot go on."""
        for c in self.fixed:
            if c.proc.poll() is not None:
                raise ServiceFailed(failure(c, "during the run"))
        now = self.clock()
        for slot in self.slots:
            if not slot.given_up:
                self._check(slot, now)
        for role in REPLICATED:
            slots = [s for s in self.slots if s.child.role == role]
            if slots and all(s.given_up for s in slots):
                raise ServiceFailed(f"every {role} replica is lost ({self.policy.max_restarts} restarts each "
                                    f"failed); last: {slots[-1].last_failure}")

    def _check(self, slot: _Slot, now: float) -> None:
        if slot.due is not None:
            if now >= slot.due:
                self._restart(slot, now)
            return
        c = slot.child
        if c.proc.poll() is not None:
            self._died(slot, now, failure(c, "during the run" if slot.serving_since is not None else "before serving"))
        elif slot.serving_since is None:
            if self.launcher.poll_ready(c):
                slot.serving_since = now
                self.say(f"meshrl up: {c.role}-{c.index} restarted and serving on {c.address} "
                         f"(restart {slot.restarts} of {self.policy.max_restarts}; log: {c.log_path})")
            elif now - slot.started > self.policy.ready_timeout_s:
                c.proc.kill()
                c.proc.wait()
                self._died(slot, now, f"{c.role}-{c.index} did not announce an address within "
                                      f"{self.policy.ready_timeout_s:g}s of its restart (log: {c.log_path})")
        elif slot.restarts and now - slot.serving_since >= self.policy.stable_s:
            slot.restarts = 0

    def _died(self, slot: _Slot, now: float, line: str) -> None:
        slot.last_failure = line
        if slot.restarts >= self.policy.max_restarts:
            slot.given_up = True
            self.say(f"meshrl up: {line}; given up after {slot.restarts} restarts in a row")
            return
        delay = min(self.policy.backoff_s * 2 ** slot.restarts, self.policy.max_backoff_s)
        slot.restarts += 1
        slot.due = now + delay
        self.say(f"meshrl up: {line}; restarting it in {delay:g}s (restart {slot.restarts} of "
                 f"{self.policy.max_restarts})")

    def _restart(self, slot: _Slot, now: float) -> None:
        slot.total += 1
        slot.child = self.launcher.restart(slot.child, slot.total, slot.port)
        slot.due, slot.started, slot.serving_since = None, now, None
