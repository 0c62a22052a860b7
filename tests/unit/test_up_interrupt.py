"""`meshrl up`'s interrupt and resume pieces: the resume command line, the run config without the mesh's
addresses, and a resumed run's recorded config pointed at the replicas it reaches now."""

import os
import signal
import time
from types import SimpleNamespace

import pytest

from coordinator.cli import runs
from coordinator.cli.common import Interrupted
from coordinator.cli.interrupt import check_resumable, resume_command, resume_line, sigterm_as_interrupt
from coordinator.recipe.config import RunConfig
from coordinator.training.algorithms import live_addresses
from services.common.config import load_config


def test_the_resume_command_is_this_command_line_with_resume_after_up_in_place_of_any_earlier_one():
    argv = ["up", "recipes/a b.yaml", "--run.num_steps", "6", "--resume", "old-run", "data.seed=3"]
    assert resume_command("r-1", argv) == ("meshrl up --resume r-1 'recipes/a b.yaml' --run.num_steps 6 "
                                           "data.seed=3")
    assert resume_command("r-1", ["--debug", "up", "x.yaml", "--resume=old"]) == "meshrl --debug up --resume r-1 x.yaml"


def test_an_interrupted_run_without_a_run_store_says_it_cannot_be_resumed_and_why():
    status = SimpleNamespace(step=3, num_steps=6, checkpoint_path="", finished=False)
    assert resume_line("r-1", status, resumable=False) == (
        "meshrl up: run r-1 interrupted at step 3/6; its record lived in the coordinator's memory (no "
        "run.redis_url), so it cannot be resumed: set run.redis_url to make runs resumable")


def test_sigterm_raises_interrupted_with_its_signal_number_and_the_old_handler_comes_back():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as err:
        with sigterm_as_interrupt():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)       # interrupted by the handler's raise (it may come before the sleep: no race)
    assert isinstance(err.value, KeyboardInterrupt) and err.value.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before


def test_meshrl_ups_run_config_leaves_the_mesh_addresses_to_the_coordinators_default_pools():
    raw = {"rollout": {"servers": ["10.0.0.9:1"], "n": 4}, "trainer": {"address": "10.0.0.9:2"}}
    addresses = {"rollout": ["127.0.0.1:5"], "reward": ["127.0.0.1:6"], "trainer": ["127.0.0.1:7"],
                 "env": ["127.0.0.1:8"]}
    data = runs._run_data(raw, {}, addresses)
    assert data["rollout"] == {"n": 4, "rejoin_wait_s": runs.REJOIN_WAIT_S}
    assert data["reward"] == {"rejoin_wait_s": runs.REJOIN_WAIT_S} and "address" not in data["trainer"]
    assert data["env"]["servers"] == ["127.0.0.1:8"]     # the rollout replicas call these, not the coordinator


def test_a_resumed_runs_recorded_config_takes_the_addresses_it_reaches_now_and_keeps_every_other_key():
    recorded = {"rollout": {"servers": ["127.0.0.1:1"], "n": 4}, "trainer": {"address": "127.0.0.1:2"},
                "actor": {"lr": 0.5}}
    now = load_config(RunConfig, data={"rollout": {"servers": ["127.0.0.1:9"]}, "trainer": {"address": "h:3"}})
    out = live_addresses(recorded, now)
    assert out["rollout"] == {"servers": ["127.0.0.1:9"], "n": 4, "dns": None, "registry": False}
    assert out["trainer"] == {"address": "h:3"} and out["actor"] == {"lr": 0.5}
    assert recorded["rollout"]["servers"] == ["127.0.0.1:1"]         # the record itself is not changed


def test_a_run_that_ended_before_the_interrupt_has_no_resume_line():
    status = SimpleNamespace(step=6, num_steps=6, checkpoint_path="", state="COMPLETED", finished=True)
    assert resume_line("r-1", status, resumable=True) == \
        "meshrl up: run r-1 COMPLETED after 6 steps; there is nothing to resume"


class _Client:
    """The coordinator as `meshrl up` sees it when a service dies: alive (it answers GetRun) or gone."""

    def __init__(self, alive: bool):
        self.alive = alive

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def get_run(self, run_id):
        import grpc

        if not self.alive:
            raise grpc.RpcError("UNAVAILABLE: Connection refused")
        return SimpleNamespace(step=26, num_steps=30, checkpoint_path="", state="RUNNING", finished=False)


@pytest.mark.parametrize("redis_url", ["redis://127.0.0.1:6379/0", ""])
@pytest.mark.parametrize("coordinator_alive", [True, False])
def test_a_trainer_or_coordinator_that_dies_mid_run_ends_meshrl_up_with_the_resume_line(monkeypatch, redis_url,
                                                                                       coordinator_alive):
    """Found by `kill -9` of the trainer under `meshrl up ... --run.redis_url ...`: it ended with the trainer's
    cause line only, though `meshrl up --resume RUN_ID ...` continues the run."""
    from coordinator.cli.launcher import ServiceFailed

    said: list[str] = []
    monkeypatch.setattr(runs, "say", said.append)
    monkeypatch.setattr(runs, "_start_or_resume", lambda client, data, resume: ("r-1", 0))

    def dies(*args):
        raise ServiceFailed("trainer-0 exited with code -9 during the run: killed by SIGKILL (log: t.log)")

    monkeypatch.setattr(runs, "_follow_while_alive", dies)
    monkeypatch.setattr("sys.argv", ["meshrl", "up", "grpo.yaml", "--run.redis_url", redis_url])
    conn = SimpleNamespace(client=lambda: _Client(coordinator_alive))
    cfg = SimpleNamespace(run=SimpleNamespace(num_steps=30, zero_variance_warn_steps=3, redis_url=redis_url))
    with pytest.raises(ServiceFailed, match="trainer-0 exited"):
        runs._drive(None, {}, conn, cfg)
    at = " at step 26/30" if coordinator_alive else ""
    if redis_url:
        assert said == [f"meshrl up: run r-1 interrupted{at}; resume it with: meshrl up --resume r-1 grpo.yaml "
                        f"--run.redis_url {redis_url}"]
    else:
        assert said == [f"meshrl up: run r-1 interrupted{at}; its record lived in the coordinator's memory (no "
                        f"run.redis_url), so it cannot be resumed: set run.redis_url to make runs resumable"]


def test_resume_names_a_run_the_store_holds_with_steps_left_before_any_service_starts(redis_url):
    """`meshrl up --resume TYPO` failed only after the whole mesh had started; the run store is asked first."""
    import asyncio
    import uuid

    from coordinator.runapi.store import RedisStore, RunRecord

    run = SimpleNamespace(redis_url=redis_url, redis_prefix=f"test-resume-{uuid.uuid4().hex[:8]}")

    async def put(*records):
        store = RedisStore(redis_url, prefix=run.redis_prefix)
        for r in records:
            await store.put(r)
        await store.close()

    asyncio.run(put(RunRecord(run_id="run-a", config="", state="PAUSED", step=3, num_steps=6),
                    RunRecord(run_id="run-b", config="", state="COMPLETED", step=6, num_steps=6)))
    check_resumable(run, "run-a")                                   # paused with steps left: fine
    with pytest.raises(ValueError, match=r"--resume: run 'run-b' is COMPLETED; there is nothing to resume"):
        check_resumable(run, "run-b")
    with pytest.raises(ValueError) as err:
        check_resumable(run, "run-x")
    message = str(err.value)
    assert message.startswith("--resume: no run 'run-x' in the store at run.redis_url")
    assert "run-a (PAUSED, step 3/6)" in message and "run-b (COMPLETED, step 6/6)" in message
    assert redis_url not in message


def test_resume_with_a_store_that_does_not_answer_is_refused_by_name():
    run = SimpleNamespace(redis_url="redis://:secret@127.0.0.1:1/0", redis_prefix="meshrl")
    with pytest.raises(ValueError, match=r"^--resume: the run store at run.redis_url did not answer") as err:
        check_resumable(run, "run-a", timeout_s=2)
    assert "secret" not in str(err.value)
