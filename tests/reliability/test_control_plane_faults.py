"""kill -9 of the coordinator, the trainer and Redis in the middle of a run, every service its own process."""

import json
import subprocess
import time
import uuid
from pathlib import Path

import grpc
import pytest
import redis
import yaml

from coordinator.client import Client

from tests import ports
from tests.reliability.procs import Procs, run_config, wait_until, with_addresses, write_config

pytestmark = [pytest.mark.slow, pytest.mark.redis]


def _steps(records) -> list[int]:
    """Committed steps: training metrics, or a step the trainer applied before a coordinator died (recovered)."""
    return [int(m["step"]) for m in records if "reward_mean" in m or m.get("recovered")]


def _mesh(procs: Procs, num_rollout: int = 2, rollout_args=()) -> dict[str, list[str]]:
    children = procs.start_all([("trainer", []), ("reward", []),
                                *[("rollout", list(rollout_args))] * num_rollout])
    return {"trainer": [children[0].address], "reward": [children[1].address],
            "rollout": [c.address for c in children[2:]]}


def test_a_coordinator_killed_mid_run_resumes_from_its_last_completed_step_without_gap_or_repeat(
        arith_model_path, tmp_path, redis_url):
    cfg = run_config(arith_model_path, tmp_path / "runs", run={"num_steps": 6})
    path = write_config(tmp_path / "run.yaml", cfg)
    prefix = f"meshrl-rel-{uuid.uuid4().hex[:8]}"
    coordinator_args = ["--run.redis_url", redis_url, "--run.redis_prefix", prefix]
    with Procs(path, tmp_path / "logs") as procs:
        addresses = _mesh(procs)
        coordinator = procs.start("coordinator", args=coordinator_args)
        with Client(coordinator.address) as client:
            run_id = client.start_run(yaml.safe_dump(with_addresses(cfg, addresses)))
            wait_until(lambda: client.get_run(run_id).step >= 2, 300, "two completed steps")
        Procs.kill9(coordinator)
        store = redis.Redis.from_url(redis_url, decode_responses=True)
        killed = json.loads(store.get(f"{prefix}:run:{run_id}"))
        assert killed["state"] == "RUNNING" and killed["step"] >= 2
        assert _steps(map(json.loads, store.lrange(f"{prefix}:run:{run_id}:metrics", 0, -1))) == \
            list(range(1, killed["step"] + 1))

        restarted = procs.start("coordinator", args=coordinator_args)
        with Client(restarted.address) as client:
            final = client.wait(run_id)
            assert final.state == "COMPLETED", final.message
            assert final.step == 6 and final.data_position == 6 * 4
            records = list(client.stream_metrics(run_id))
            assert _steps(records) == [1, 2, 3, 4, 5, 6]    # no gap, no repeat
            assert final.weight_version == 6                # no step trained twice
        # Killed between an update and its commit, that step is committed as recovered, not trained again.
        recovered = [int(m["step"]) for m in records if m.get("recovered")]
        assert recovered in ([], [killed["step"] + 1])
        assert f"resuming run {run_id} at step {killed['step'] + len(recovered)}" in Procs.log(restarted)
        lines = (Path(final.run_dir) / "metrics.jsonl").read_text().splitlines()
        assert _steps(map(json.loads, lines)) == [1, 2, 3, 4, 5, 6]
        store.close()


def test_a_killed_trainer_pauses_the_run_with_the_reason_and_resume_run_continues_from_its_checkpoint(
        arith_model_path, tmp_path):
    cfg = run_config(arith_model_path, tmp_path / "runs", run={"num_steps": 6, "checkpoint_every": 2},
                     actor={"lr": 2e-3})
    path = write_config(tmp_path / "run.yaml", cfg)
    with Procs(path, tmp_path / "logs") as procs:
        addresses = _mesh(procs)
        trainer = next(c for c in procs.launcher.children if c.role == "trainer")
        coordinator = procs.start("coordinator")
        with Client(coordinator.address) as client:
            run_id = client.start_run(yaml.safe_dump(with_addresses(cfg, addresses)))
            wait_until(lambda: client.get_run(run_id).step >= 3, 300, "three completed steps")
            Procs.kill9(trainer)
            paused = wait_until(lambda: (s := client.get_run(run_id)).state in ("PAUSED", "FAILED") and s, 120,
                                "the run to notice the trainer is gone")
            assert paused.state == "PAUSED", paused.message
            assert "trainer" in paused.message and "unavailable" in paused.message
            at = paused.step
            assert at >= 3 and paused.checkpoint_path.endswith(f"step_{at - at % 2}")
            assert paused.message.endswith(f"then ResumeRun continues from step {at} (from the last checkpoint's "
                                           f"step {at - at % 2} if the trainer lost its weights)")
            saved_at = at - at % 2

            with pytest.raises(grpc.RpcError) as err:                      # the trainer is still down
                client.resume_run(run_id)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "trainer" in err.value.details()
            still = client.get_run(run_id)
            assert (still.state, still.step) == ("PAUSED", at)             # nothing ran without a trainer

            procs.restart(trainer)                                         # a fresh process: initial weights
            assert client.resume_run(run_id).state == "RUNNING"
            final = client.wait(run_id)
            assert final.state == "COMPLETED", final.message
            assert final.step == 6
            # The run went back to the checkpoint's step and data position and replayed the steps after it on
            # the checkpoint's weights: every step's update is in the final weights once (a fresh trainer
            # would be at 6 - at, the checkpoint's weights kept at the run's step at saved_at + 6 - at).
            assert final.weight_version == 6 and final.data_position == 6 * 4
            records = list(client.stream_metrics(run_id))
        assert _steps(records) == [1, 2, 3, 4, 5, 6]
        assert f"trainer restored from {paused.checkpoint_path}" in Procs.log(coordinator)
        assert (f"run {run_id}: the trainer lost the weights of step {at}; replaying from step {saved_at} (data "
                f"position {saved_at * 4}) on checkpoint {paused.checkpoint_path}") in Procs.log(coordinator)
        by_step = {int(m["step"]): m for m in records if "reward_mean" in m}
        # The replicas got the restored weights pushed: they and the trainer score tokens alike again
        # (weights one update apart would differ by orders of magnitude more).
        normal = max(by_step[s]["rollout_vs_trainer/logprob_abs_diff"] for s in range(1, saved_at + 1))
        assert by_step[saved_at + 1]["rollout_vs_trainer/logprob_abs_diff"] <= max(10 * normal, 1e-4)


class RedisServer:
    """A redis-server of the test's own (the shared one on 6379 is never touched). It cannot bind port 0 and report
    it (`--port 0` turns TCP off): it starts on a port of tests/ports.py's range (another one while that one is in
    use) and is restarted on the same one mid-test."""

    def __init__(self, workdir: Path, *, aof: bool):
        self.port: int | None = None
        self.workdir = workdir
        self.aof = aof
        self.proc = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = ports.start_on_a_port(self._start, port=self.port, attempts=8 if self.port is None else 25)

    def _start(self, port: int) -> int:
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.aof else ["--appendonly", "no"]
        log = self.workdir / "redis-server.log"
        with log.open("w") as out:
            self.proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                                          "--dir", str(self.workdir), "--save", "", *persistence],
                                         stdout=out, stderr=subprocess.STDOUT)
        client = redis.Redis(port=port)
        try:
            wait_until(lambda: self.proc.poll() is not None or _pings(client), 30, "redis-server to start")
        finally:
            client.close()
        if self.proc.poll() is not None:
            if ports.in_use(log.read_text()):
                time.sleep(0.2)
                raise ports.PortInUse(port)
            raise AssertionError(f"redis-server exited with {self.proc.returncode}:\n{log.read_text()[-2000:]}")
        return port

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)

    def close(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.kill9()


def _check_no_commit_while_redis_was_down(records, killed_at: float, back_at: float, committed: list[int]) -> None:
    """A step's metrics get their timestamp just before its commit, and metrics.jsonl its line just after Redis
    took it (`committed`: the lines at the end of the outage). A commit begun with Redis gone waited for Redis to
    come back (at most one: the run waits on it), and none landed while Redis was down."""
    began = {int(m["step"]): m["timestamp"] for m in records if "reward_mean" in m}
    waited = [s for s, t in began.items() if killed_at <= t <= back_at]
    assert len(waited) <= 1 and not set(waited) & set(committed), (waited, committed)
    assert all(began[s] < killed_at for s in committed), (began, killed_at)
    assert max(committed, default=0) < 8                                # steps were left for after the outage


def _pings(client) -> bool:
    try:
        return client.ping()
    except redis.exceptions.ConnectionError:
        return False


def test_run_state_survives_a_redis_restart_with_aof_and_services_re_register_by_heartbeat(
        arith_model_path, tmp_path):
    server = RedisServer(tmp_path / "redis", aof=True)
    server.start()
    cfg = run_config(arith_model_path, tmp_path / "runs", run={"num_steps": 8},
                     rollout={"registry": True})
    path = write_config(tmp_path / "run.yaml", cfg)
    try:
        # Rollout replicas are found through the registry only; every service heartbeats into it.
        with Procs(path, tmp_path / "logs", overrides={"server.registry_url": server.url}) as procs:
            addresses = _mesh(procs)
            coordinator = procs.start("coordinator", args=["--run.redis_url", server.url])
            run_cfg = with_addresses(cfg, addresses)
            run_cfg["rollout"].pop("servers")
            r = redis.Redis(port=server.port, decode_responses=True)
            wait_until(lambda: len(r.zrange("meshrl:services:rollout", 0, -1)) == 2, 30, "registrations")
            with Client(coordinator.address) as client:
                run_id = client.start_run(yaml.safe_dump(run_cfg))
                wait_until(lambda: client.get_run(run_id).step >= 2, 300, "two completed steps")
                before = client.get_run(run_id)
                server.kill9()
                killed_at = time.time()
                # Redis stays away a while: the run's next store call meets no Redis and retries (RedisStore's
                # Retry) instead of failing. The assertions below hold for any outage length, so this wait orders
                # nothing they check.
                time.sleep(3.0)
                jsonl = Path(before.run_dir) / "metrics.jsonl"
                committed_in_outage = _steps(map(json.loads, jsonl.read_text().splitlines()))
                back_at = time.time()
                server.start()
                final = client.wait(run_id)
                assert final.state == "COMPLETED", final.message
                assert final.step == 8 and final.data_position == 8 * 4
                records = list(client.stream_metrics(run_id))
            assert before.step < 8                                         # Redis went away mid-run
            assert _steps(records) == list(range(1, 9))                   # nothing lost, nothing twice
            _check_no_commit_while_redis_was_down(records, killed_at, back_at, committed_in_outage)
            r = redis.Redis(port=server.port, decode_responses=True)
            stored = json.loads(r.get(f"meshrl:run:{run_id}"))
            assert stored["state"] == "COMPLETED" and stored["config"] == yaml.safe_dump(run_cfg)
            assert "run " + run_id + " failed" not in Procs.log(coordinator)

            # A Redis that comes back empty: the heartbeat re-registers every service within its period.
            server.kill9()
            for f in (tmp_path / "redis").rglob("*"):
                if f.is_file():
                    f.unlink()
            server.start()
            r = redis.Redis(port=server.port, decode_responses=True)
            assert r.zrange("meshrl:services:rollout", 0, -1) == []
            wait_until(lambda: sorted(r.zrange("meshrl:services:rollout", 0, -1)) == sorted(addresses["rollout"])
                       and r.zrange("meshrl:services:trainer", 0, -1) == addresses["trainer"]
                       and r.zrange("meshrl:services:reward", 0, -1) == addresses["reward"], 15,
                       "every service to re-register")
            r.close()
    finally:
        server.close()
