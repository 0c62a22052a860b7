"""deploy/docker-compose.yml's commands run for real: each service's command and environment, as Compose
resolves them, started as a local process (container hostnames -> 127.0.0.1, container ports -> port 0, each
service's address the one it announces; compose starts a service after its dependencies, the only services it
addresses, so every address it is given is known by then;
Redis -> a spare DB of the local server); each must pass the compose file's own health check, and three
rollout replicas started that way must all be in the Redis registry, where the coordinator's pools look; the training
API must sample through the compose wiring."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from coordinator.client import Client
from services.common.roles import API_ROLES, SERVICE_ROLES
from services.common.rpc.registry import Registry
from tests.integration.test_deploy import COMPOSE, REPO, compose_model

pytestmark = [pytest.mark.slow, pytest.mark.redis]

NUM_ROLLOUT = 3
START_POLLS = 750            # a bound on the start loop's passes (0.2 s apart), not a timing assertion
BIN = Path(sys.executable).parent


@dataclass
class Service:
    """One compose service replica as a local process; its port is the one it announces once started."""

    name: str
    spec: dict
    log: Path
    env: dict[str, str] | None = None
    health: list[str] | None = None
    port: int = 0
    proc: subprocess.Popen | None = None
    healthy: bool = False
    next_check: float = 0.0

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def start(self, loc: "Localizer", base_env: dict[str, str], app_dir: Path) -> None:
        """Started on port 0, with the addresses of the services started before it (its dependencies)."""
        env = {k: loc.value(str(v)) for k, v in self.spec["environment"].items()}
        # A container's 0.0.0.0 is its own address; here that is loopback, which is also what the replica then
        # advertises (advertise_host defaults to host unless host is 0.0.0.0).
        if env.get("MESHRL_SERVER__HOST") == "0.0.0.0":
            env["MESHRL_SERVER__HOST"] = "127.0.0.1"
        env["MESHRL_SERVER__PORT"] = "0"
        # Each container has the metrics port to itself; here every process shares loopback: port 0 too.
        if "MESHRL_SERVER__METRICS_PORT" in env:
            env["MESHRL_SERVER__METRICS_PORT"] = "0"
        self.env = {**base_env, **env}
        argv = loc.argv(self.spec["command"])
        unresolved = [v for v in [*env.values(), *argv] if loc.names_a_service(v)]
        assert not unresolved, f"{self.name} names a service not started before it: {unresolved}"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(argv, env=self.env, cwd=app_dir, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def announced(self, loc: "Localizer") -> bool:
        """Whether it said where it listens (`meshrl <role> listening on 127.0.0.1:<port>`); learns its port."""
        if not self.port:
            found = re.search(rf"meshrl {role(self)} listening on 127\.0\.0\.1:(\d+)", self.log.read_text())
            if not found:
                return False
            self.port = int(found[1])
            loc.ports.setdefault(role(self), self.port)          # how other services address it (one replica)
            test = self.spec["healthcheck"]["test"]
            assert test[0] == "CMD", f"{self.name}: health check must be an exec form"
            self.health = loc.argv(test[1:], role(self), self.port)
        return True


class Localizer:
    """Rewrites a value from the compose model so it means the same thing on this machine."""

    def __init__(self, model: dict, redis_url: str, app_dir: Path):
        self.ports: dict[str, int] = {}       # each started service's announced port
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

    def names_a_service(self, value: str) -> bool:
        return any(re.search(rf"\b{re.escape(n)}:{p}\b", value) for n, p in self.container_port.items() if p)

    def argv(self, argv: list[str], own: str | None = None, own_port: int | None = None) -> list[str]:
        out = [self.value(a, own, own_port) for a in argv]
        if out[0] in ("meshrl", "python", "torchrun"):
            out[0] = sys.executable if out[0] == "python" else str(BIN / out[0])
        return out


def plan(model: dict, logs: Path) -> list[Service]:
    services = model["services"]
    # services/common/roles.py's start order; the coordinator and the training API (clients of the others) last
    order = [*SERVICE_ROLES, "coordinator", *API_ROLES]
    # `run` (the one-shot driver that starts the recipe) is left out: this test starts its own run;
    # tests/integration/test_compose_up.py runs the real thing
    assert set(order) | {"redis", "run"} == set(services)
    for name in order:
        assert services[name]["healthcheck"]["test"], name
    replicas = {name: NUM_ROLLOUT if name == "rollout" else 1 for name in order}
    return [Service(f"{name}-{i}", services[name], logs / f"{name}-{i}.log")
            for name in order for i in range(replicas[name])]


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


def start_in_dependency_order(services: list[Service], model: dict, loc: Localizer, base_env: dict[str, str],
                              app_dir: Path) -> None:
    """As compose does: a service starts once every replica of its dependencies passed its health check."""
    polls = 0
    while not all(s.healthy for s in services):
        now = time.monotonic()                  # schedules the health checks; asserts nothing
        polls += 1
        assert polls < START_POLLS, "not healthy in time: " + ", ".join(
            f"{s.name} ({'started' if s.proc else 'waiting'})" for s in services if not s.healthy)
        unhealthy_roles = {role(s) for s in services if not s.healthy}
        for s in services:
            # Compose's `condition: service_healthy`: start once every dependency's replicas are healthy.
            if s.proc is None and not depends_on(model, s) & unhealthy_roles:
                s.start(loc, base_env, app_dir)
                s.next_check = now + 1.0
        for s in services:
            if s.proc is None or s.healthy or now < s.next_check:
                continue
            assert s.proc.poll() is None, f"{s.name} exited with {s.proc.returncode}:\n{s.tail()}"
            if not s.announced(loc):
                continue
            check = subprocess.run(s.health, env=s.env, cwd=app_dir, capture_output=True, timeout=30)
            s.healthy = check.returncode == 0
            s.next_check = time.monotonic() + 2.0      # the compose file's start_interval
        time.sleep(0.2)


def sample_through_training_api(address: str):
    """One full-parameter client of the composed training API (the recipe trains every weight): two samples."""
    from services.training_api.client import ModelInput, SamplingParams, ServiceClient

    service = ServiceClient(address)
    try:
        tc = service.create_lora_training_client(base_model="examples/arith/model", rank=0)
        try:
            prompt = tc.get_tokenizer().encode("12+7=")
            return tc.sample(ModelInput.from_ints(prompt), 2, SamplingParams(max_tokens=4, temperature=1.0)).result()
        finally:
            tc.close()
    finally:
        service.close()


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
    services = plan(model, tmp_path / "logs")
    loc = Localizer(model, local_redis, app_dir)
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("MESHRL_")}
    base_env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                    MESHRL_RUN__REDIS_PREFIX=prefix)   # this test's own keys: registry and run state
    assert sum(role(s) == "rollout" for s in services) == NUM_ROLLOUT
    try:
        start_in_dependency_order(services, model, loc, base_env, app_dir)
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
        # The training API reaches the trainer and a rollout replica through its compose environment alone
        # (MESHRL_TRAINER__ADDRESS, MESHRL_ROLLOUT__DNS): a client opens, and samples after the weights' push.
        training = next(s for s in services if role(s) == "training")
        sampled = sample_through_training_api(f"127.0.0.1:{training.port}")
        assert len(sampled.sequences) == 2 and all(seq.tokens for seq in sampled.sequences), sampled
    finally:
        stop(services)
    # a replica that stops leaves the registry at once, so the coordinator stops routing to it
    listed = asyncio.run(registered(local_redis, prefix))
    assert not {f"127.0.0.1:{s.port}" for s in services} & set(listed["rollout"] + listed["reward"])
