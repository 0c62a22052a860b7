"""coordinator/cli/supervisor.py with fake processes and a fake clock: restarts with back-off, bounded tries, and what
ends `meshrl up` (the coordinator, the trainer, every replica of a role)."""

from dataclasses import dataclass
from pathlib import Path

import pytest

from coordinator.cli.launcher import Child, ServiceFailed
from coordinator.cli.supervisor import RestartPolicy, Supervisor


@dataclass
class FakeProc:
    returncode: int | None = None

    def poll(self):
        return self.returncode

    def kill(self):
        self.returncode = -9

    def wait(self, timeout=None):
        return self.returncode


class FakeLauncher:
    """Children that announce when told to; restart() makes a new one that has not announced yet."""

    def __init__(self, tmp: Path, roles: list[tuple[str, int]]):
        self.tmp = tmp
        self.children = [self._child(role, i, f"{role}-{i}.log", f"127.0.0.1:{5000 + n}")
                         for n, (role, i) in enumerate(roles)]
        self.restarts: list[tuple[str, int, int]] = []
        self.ready = True

    def _child(self, role, index, log_name, address=""):
        log = self.tmp / log_name
        log.write_text("INFO serving\nRuntimeError: boom\n")
        return Child(role, index, FakeProc(), log, address=address)

    def restart(self, child, attempt, port):
        self.restarts.append((child.role, child.index, port))
        new = self._child(child.role, child.index, f"{child.role}-{child.index}.restart-{attempt}.log")
        self.children.append(new)
        return new

    def poll_ready(self, child):
        if self.ready:
            child.address = child.address or "127.0.0.1:5002"
        return self.ready


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _mesh(tmp_path, policy=RestartPolicy(max_restarts=2, backoff_s=1.0, stable_s=60.0)):
    launcher = FakeLauncher(tmp_path, [("trainer", 0), ("rollout", 0), ("rollout", 1), ("reward", 0),
                                       ("coordinator", 0)])
    said, clock = [], Clock()
    return launcher, Supervisor(launcher, said.append, policy, clock), said, clock


def _rollout(sup, index):
    return next(s for s in sup.slots if s.child.role == "rollout" and s.child.index == index)


def test_a_dead_replica_is_restarted_on_its_port_after_the_back_off_and_says_so(tmp_path):
    launcher, sup, said, clock = _mesh(tmp_path)
    _rollout(sup, 1).child.proc.returncode = -9
    sup.check()
    log = tmp_path / "rollout-1.log"
    assert said == [f"meshrl up: rollout-1 exited with code -9 during the run: RuntimeError: boom (log: {log}); "
                    f"restarting it in 1s (restart 1 of 2)"]
    clock.now = 0.5
    sup.check()
    assert launcher.restarts == []                      # still backing off
    clock.now = 1.0
    launcher.ready = False
    sup.check()
    assert launcher.restarts == [("rollout", 1, 5002)]
    launcher.ready = True
    sup.check()
    assert said[-1] == (f"meshrl up: rollout-1 restarted and serving on 127.0.0.1:5002 (restart 1 of 2; log: "
                        f"{tmp_path / 'rollout-1.restart-1.log'})")


def test_back_off_doubles_and_a_replica_is_given_up_after_its_tries_while_the_run_goes_on(tmp_path):
    launcher, sup, said, clock = _mesh(tmp_path)
    launcher.ready = False
    for clock.now, delay in ((0.0, "1s"), (1.0, "2s")):
        _rollout(sup, 1).child.proc.returncode = 1
        sup.check()
        assert said[-1].endswith(f"restarting it in {delay} (restart {len(said)} of 2)"), said[-1]
        clock.now += float(delay[:-1])
        sup.check()                                     # the restart starts, and dies before serving
    _rollout(sup, 1).child.proc.returncode = 1
    sup.check()
    assert said[-1] == (f"meshrl up: rollout-1 exited with code 1 before serving: RuntimeError: boom (log: "
                        f"{tmp_path / 'rollout-1.restart-2.log'}); given up after 2 restarts in a row")
    clock.now += 100
    sup.check()                                         # rollout-0 still serves: no error
    assert len(launcher.restarts) == 2


def test_losing_every_replica_of_a_role_ends_the_run_with_the_last_cause(tmp_path):
    launcher, sup, said, clock = _mesh(tmp_path, RestartPolicy(max_restarts=0))
    _rollout(sup, 0).child.proc.returncode = -9
    sup.check()
    _rollout(sup, 1).child.proc.returncode = -9
    with pytest.raises(ServiceFailed) as e:
        sup.check()
    assert str(e.value) == (f"every rollout replica is lost (0 restarts each failed); last: rollout-1 exited with "
                            f"code -9 during the run: RuntimeError: boom (log: {tmp_path / 'rollout-1.log'})")


@pytest.mark.parametrize("role", ["trainer", "coordinator"])
def test_the_trainer_or_the_coordinator_dying_ends_the_run_at_once(tmp_path, role):
    launcher, sup, said, clock = _mesh(tmp_path)
    next(c for c in launcher.children if c.role == role).proc.returncode = -9
    with pytest.raises(ServiceFailed) as e:
        sup.check()
    assert str(e.value) == (f"{role}-0 exited with code -9 during the run: RuntimeError: boom "
                            f"(log: {tmp_path / f'{role}-0.log'})")
    assert said == []


def test_a_replica_that_served_long_enough_gets_its_tries_back(tmp_path):
    launcher, sup, said, clock = _mesh(tmp_path)
    slot = _rollout(sup, 0)
    slot.child.proc.returncode = -9
    sup.check()
    clock.now = 1.0
    sup.check()                                         # restarted
    sup.check()                                         # serving since t=1
    assert slot.restarts == 1
    clock.now = 61.0
    sup.check()
    assert slot.restarts == 0
    slot.child.proc.returncode = -9
    sup.check()
    assert said[-1].endswith("restarting it in 1s (restart 1 of 2)")
