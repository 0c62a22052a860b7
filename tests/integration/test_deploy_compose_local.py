"""deploy/docker-compose.yml's commands run for real: each service's command and environment, as Compose
resolves them, started as a local process (container hostnames -> 127.0.0.1, container ports -> free ports,
Redis -> a spare DB of the local server); each must pass the compose file's own health check, and three
rollout replicas started that way must all be in the Redis registry, where the coordinator's pools look."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from coordinator.client import Client
from services.common.rpc.registry import Registry
from tests.integration.test_deploy import COMPOSE, REPO, compose_model

pytestmark = [pytest.mark.slow, pytest.mark.redis]

NUM_ROLLOUT = 3
START_POLLS = 750            # a bound on the start loop's passes (0.2 s apart), not a timing assertion
BIN = Path(sys.executable).parent


def free_port() -> int:
    # Kept here: compose addresses each service by a port fixed before any of them starts (the coordinator's
    # and the replicas' settings name it), which is what this test checks; a service cannot pick its own.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Service:
    """One compose service replica as a local process."""

    name: str
    argv: list[str]
    env: dict[str, str]
    health: list[str]
    port: int
    log: Path
    proc: subprocess.Popen | None = None
    healthy: bool = False
    next_check: float = 0.0

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


class Localizer:
    """Rewrites a value from the compose model so it means the same thing on this machine."""

    def __init__(self, model: dict, ports: dict[str, int], redis_url: str, app_dir: Path):
        self.ports = ports
        self.redis_url = redis_url
        self.container_port = {n: s.get("environment", {}).get("MESHRL_SERVER__PORT") for n, s in model["services"].items()}
        # bind mounts point at the host path; named volumes at a folder under the app dir
        self.paths: dict[str, str] = {}
        for svc in model["services"].values():
            for v in svc.get("volumes", []):
                self.paths[v["target"]] = v["source"] if v["type"] == "bind" else str(app_dir / Path(v["target"]).name)

    def value(self, value: str, own: str | None = None, own_port: int | None = None) -> str:
        value = re.sub(r"redis://redis:6379/\d+", self.redis_url, value)
        for name, port in self.ports.items():
            if self.container_port.get(name):
                value = re.sub(rf"\b{re.escape(name)}:{self.container_port[name]}\b", f"127.0.0.1:{port}", value)
        if own_port is not None and self.container_port.get(own):
            value = value.replace(f"127.0.0.1:{self.container_port[own]}", f"127.0.0.1:{own_port}")
        return self.paths.get(value, value)

    def argv(self, argv: list[str], own: str, own_port: int) -> list[str]:
        out = [self.value(a, own, own_port) for a in argv]
        if out[0] in ("meshrl", "python", "torchrun"):
            out[0] = sys.executable if out[0] == "python" else str(BIN / out[0])
        return out


def plan(model: dict, redis_url: str, app_dir: Path, logs: Path, prefix: str) -> list[Service]:
    services = model["services"]
    order = ["trainer", "reference", "reward", "env", "rollout", "coordinator"]
    # `run` (the one-shot driver that starts the recipe) is left out: this test starts its own run;
    # tests/integration/test_compose_up.py runs the real thing
    assert set(order) | {"redis", "run"} == set(services)
    replicas = {name: NUM_ROLLOUT if name == "rollout" else 1 for name in order}
    ports = {name: free_port() for name in order}          # how other services address it (one replica)
    loc = Localizer(model, ports, redis_url, app_dir)
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("MESHRL_")}
    base_env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                    MESHRL_RUN__REDIS_PREFIX=prefix)   # this test's own keys: registry and run state
    planned = []
    for name in order:
        svc = services[name]
        for i in range(replicas[name]):
            port = ports[name] if i == 0 else free_port()
            env = {k: loc.value(str(v)) for k, v in svc["environment"].items()}
            # A container's 0.0.0.0 is its own address; here that is loopback, which is also what the
            # replica then advertises (advertise_host defaults to host unless host is 0.0.0.0).
            if env.get("MESHRL_SERVER__HOST") == "0.0.0.0":
                env["MESHRL_SERVER__HOST"] = "127.0.0.1"
            env["MESHRL_SERVER__PORT"] = str(port)
            # Each container has the metrics port to itself; here every process shares loopback: any free port.
            if "MESHRL_SERVER__METRICS_PORT" in env:
                env["MESHRL_SERVER__METRICS_PORT"] = "0"
            test = svc["healthcheck"]["test"]
            assert test[0] == "CMD", f"{name}: health check must be an exec form"
            planned.append(Service(f"{name}-{i}", loc.argv(svc["command"], name, port), {**base_env, **env},
                                   loc.argv(test[1:], name, port), port, logs / f"{name}-{i}.log"))
    return planned


def depends_on(model: dict, service: Service) -> set[str]:
    name = service.name.rsplit("-", 1)[0]
    return {d for d in model["services"][name].get("depends_on", {}) if d != "redis"}


def role(service: Service) -> str:
    return service.name.rsplit("-", 1)[0]


def stop(services: list[Service]) -> None:
    """SIGTERM (services drain and deregister), then SIGKILL each one's process group that is left."""
    running = [s for s in services if s.proc is not None and s.proc.poll() is None]
    for s in running:
        s.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 15
    for s in running:
        try:
            s.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for s in services:
        if s.proc is None:
            continue
        try:
            os.killpg(s.proc.pid, signal.SIGKILL)   # its own session: the service and its reward workers
        except ProcessLookupError:
            pass
        s.proc.wait()


async def registered(redis_url: str, prefix: str) -> dict[str, list[str]]:
    registry = Registry(redis_url, prefix=prefix)
    try:
        return {r: await registry.list(r) for r in ("rollout", "reward", "reference")}
    finally:
        await registry.close()


def test_every_compose_command_runs_locally_becomes_healthy_and_rollout_replicas_register(
        arith_model_path, redis_url, tmp_path):
    model = compose_model(COMPOSE)
    # A fresh key prefix: no run left unfinished by another test for the coordinator to resume.
    local_redis, prefix = redis_url, f"meshrl-compose-{uuid.uuid4().hex[:8]}"
    # The image's working directory: the example files (recipes name them relative to it) and a runs volume.
    app_dir = tmp_path / "app"
    app_dir.mkdir()
    (app_dir / "examples").symlink_to(REPO / "examples")
    (tmp_path / "logs").mkdir()
    services = plan(model, local_redis, app_dir, tmp_path / "logs", prefix)
    assert sum(role(s) == "rollout" for s in services) == NUM_ROLLOUT
    polls = 0
    try:
        while not all(s.healthy for s in services):
            now = time.monotonic()                  # schedules the health checks; asserts nothing
            polls += 1
            assert polls < START_POLLS, "not healthy in time: " + ", ".join(
                f"{s.name} ({'started' if s.proc else 'waiting'})" for s in services if not s.healthy)
            unhealthy_roles = {role(s) for s in services if not s.healthy}
            for s in services:
                # Compose's `condition: service_healthy`: start once every dependency's replicas are healthy.
                if s.proc is None and not depends_on(model, s) & unhealthy_roles:
                    with s.log.open("w") as log:
                        s.proc = subprocess.Popen(s.argv, env=s.env, cwd=app_dir, stdout=log,
                                                  stderr=subprocess.STDOUT, start_new_session=True)
                    s.next_check = now + 1.0
            for s in services:
                if s.proc is None or s.healthy or now < s.next_check:
                    continue
                assert s.proc.poll() is None, f"{s.name} exited with {s.proc.returncode}:\n{s.tail()}"
                check = subprocess.run(s.health, env=s.env, cwd=app_dir, capture_output=True, timeout=30)
                s.healthy = check.returncode == 0
                s.next_check = time.monotonic() + 2.0      # the compose file's start_interval
            time.sleep(0.2)

        listed = asyncio.run(registered(local_redis, prefix))
        for r in ("rollout", "reward", "reference"):
            ours = {f"127.0.0.1:{s.port}" for s in services if role(s) == r}
            assert listed[r] == sorted(ours), f"{r}: registry lists {listed[r]}, expected {sorted(ours)}"
        # each replica said where it listens, as `meshrl up` and the docs expect
        for s in services:
            assert f"meshrl {role(s)} listening on 127.0.0.1:{s.port}" in s.log.read_text(), s.tail()
        # A plain recipe sent to the coordinator finds the trainer and the registry through the compose
        # environment alone (MESHRL_TRAINER__ADDRESS, MESHRL_<ROLE>__REGISTRY).
        coordinator = next(s for s in services if role(s) == "coordinator")
        with Client(f"127.0.0.1:{coordinator.port}", timeout=60) as client:
            run_id = client.start_run((REPO / "examples" / "arith" / "grpo.yaml").read_text())
            replicas = client.list_services(run_id)
            client.stop_run(run_id)
        for r in ("rollout", "reward", "reference"):
            pool = {rep.address for rep in replicas if rep.pool == r and rep.healthy}
            assert pool == {f"127.0.0.1:{s.port}" for s in services if role(s) == r}, (r, replicas)
    finally:
        stop(services)
    # a replica that stops leaves the registry at once, so the coordinator stops routing to it
    listed = asyncio.run(registered(local_redis, prefix))
    assert not {f"127.0.0.1:{s.port}" for s in services} & set(listed["rollout"] + listed["reward"])
