"""`docker compose up` for real: images built offline, the arithmetic demo trained by the composed mesh, rollout
scaled to 3 and one replica killed mid-run, the coordinator restarted, `down -v` leaving nothing behind.

Needs a Docker engine (`.ci/run` installs and starts one) and the `docker compose` v2 plugin; the base image's
root file system and the wheel folder are reused from deploy/build-images.sh's cache (docs/deploy.md)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from coordinator.client import Client

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "deploy" / "docker-compose.yml"
IMAGE = "meshrl:cpu-test"
MESHRL_IMAGES = (IMAGE, "meshrl-redis:bookworm", "meshrl-base:bookworm")
RUN_ID = "compose-test"
SAMPLES_PER_STEP = 16 * 8      # examples/arith/grpo.yaml: data.rollout_batch_size x rollout.n
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def docker_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "version"], capture_output=True, timeout=30).returncode == 0


class Project:
    """One compose project of deploy/docker-compose.yml under its own name, port and images."""

    def __init__(self, tmp: Path):
        self.name = f"meshrl-test-{os.getpid()}"
        self.env_file = tmp / "compose.env"
        # Empty: docker publishes the coordinator (and the training API) on an ephemeral host port (deploy/docker-compose.yml), read back
        # with `docker compose port` (coordinator_address); no port is picked before docker binds it.
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "MESHRL_"))},
                    "MESHRL_IMAGE": IMAGE, "MESHRL_ENV_FILE": str(self.env_file),
                    "MESHRL_COORDINATOR_PORT": "", "MESHRL_TRAINING_API_PORT": "", "MESHRL_RUN_ID": RUN_ID}

    def compose(self, *args: str, timeout: float = 600) -> str:
        cmd = ["docker", "compose", "-p", self.name, "--env-file", str(self.env_file), "-f", str(COMPOSE), *args]
        out = subprocess.run(cmd, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout)
        assert out.returncode == 0, f"{' '.join(args)}: {out.stdout}\n{out.stderr}"
        return out.stdout

    def coordinator_address(self) -> str:
        """The host address docker published the coordinator's port 50051 on (127.0.0.1:<ephemeral port>)."""
        address = self.compose("port", "coordinator", "50051").strip()
        assert re.fullmatch(r"127\.0\.0\.1:\d+", address) and not address.endswith(":0"), address
        return address

    def containers(self, service: str) -> list[str]:
        return self.compose("ps", "-q", service).split()

    def running(self) -> list[str]:
        return subprocess.run(["docker", "ps", "-q", "--filter", f"label=com.docker.compose.project={self.name}"],
                              capture_output=True, text=True, timeout=60).stdout.split()


def build_offline(project: Project) -> float:
    """A clean build of meshrl's images (only the cached base tarball and wheel folder are reused)."""
    for image in MESHRL_IMAGES:
        subprocess.run(["docker", "rmi", image], capture_output=True, timeout=300)
    start = time.monotonic()
    build = [str(REPO / "deploy" / "build-images.sh"), "--offline", "--no-cache"]
    out = subprocess.run(build, cwd=REPO, env=project.env, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert project.env_file.read_text().splitlines() == ["MESHRL_REDIS_IMAGE=meshrl-redis:bookworm",
                                                         f"MESHRL_IMAGE={IMAGE}"]
    return time.monotonic() - start


def wait_for(what: str, check, timeout: float = 600, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = check()
        except Exception:  # noqa: BLE001 - the coordinator may be starting or restarting
            value = None
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def healthy(project: Project, ids: list[str]) -> bool:
    states = subprocess.run(["docker", "inspect", "-f", "{{.State.Health.Status}}", *ids], capture_output=True,
                            text=True, timeout=60).stdout.split()
    return states == ["healthy"] * len(ids)


def scale_rollout_to_three(project: Project, client: Client) -> list[str]:
    """Pauses the run, scales rollout from 1 to 3, waits until the two new replicas are healthy, resumes; their
    host:port."""
    before = set(project.containers("rollout"))
    assert len(before) == 1, before
    client.pause_run(RUN_ID)
    wait_for("the run to pause", lambda: client.get_run(RUN_ID).state == "PAUSED")
    project.compose("up", "-d", "--scale", "rollout=3", "--no-recreate", "rollout")
    new = [c for c in project.containers("rollout") if c not in before]
    assert len(new) == 2, new
    wait_for("the new rollout replicas to be healthy", lambda: healthy(project, new), timeout=300, every=1)
    client.resume_run(RUN_ID)
    # A container's hostname is its short id, which each replica registers in Redis as <hostname>:50051.
    return [f"{c[:12]}:50051" for c in new]


def drive_faults(project: Project, client: Client) -> tuple[list[str], int, int]:
    """Scaling, a killed rollout container and a restarted coordinator, while the run trains; the new replicas,
    the step they joined at and the step committed before the restart."""
    wait_for("step 2", lambda: client.get_run(RUN_ID).step >= 2)
    new = scale_rollout_to_three(project, client)
    scaled_at = client.get_run(RUN_ID).step
    wait_for("three steps on three replicas", lambda: client.get_run(RUN_ID).step >= scaled_at + 3)
    victim = project.containers("rollout")[0]
    subprocess.run(["docker", "kill", victim], check=True, capture_output=True, timeout=60)
    killed_at = client.get_run(RUN_ID).step
    wait_for("three steps after the kill", lambda: client.get_run(RUN_ID).step >= killed_at + 3)
    committed = client.get_run(RUN_ID).step
    project.compose("restart", "coordinator")
    return new, scaled_at, committed


def read_run(project: Project, tmp: Path) -> tuple[list[dict], dict]:
    """metrics.jsonl and summary.json from the `runs` volume, copied out through the (exited) run container."""
    project.compose("cp", f"run:/app/runs/{RUN_ID}", str(tmp / "run"))
    assert (tmp / "run" / "report.png").stat().st_size > 0
    metrics = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    return metrics, json.loads((tmp / "run" / "summary.json").read_text())


def check_replicas_served(steps: dict[int, dict], new: list[str], scaled_at: int) -> None:
    """After scaling, each new replica generated a share of a step at the step's current weight version."""
    served = {address: [s for s, m in steps.items() if s > scaled_at and m.get(f"rollout/samples/{address}")]
              for address in new}
    for address, at in served.items():
        assert at, f"{address} served no Generate call after it joined"
        m = steps[at[0]]
        versions = [v for k, v in m.items() if k.startswith("rollout/weight_version/")]
        assert m[f"rollout/weight_version/{address}"] == max(versions), (address, m)
        assert m["staleness_max"] == 0


@pytest.mark.skipif(not docker_answers(), reason="no Docker engine answers (`.ci/run` starts one)")
def test_compose_up_trains_the_demo_while_rollout_scales_and_a_replica_dies(tmp_path):
    project = Project(tmp_path)
    try:
        print(f"offline build of meshrl's images: {build_offline(project):.0f} s")
        start = time.monotonic()
        # one rollout replica to begin with, so that scaling to 3 adds two
        project.compose("up", "-d", "--scale", "rollout=1")
        with Client(project.coordinator_address(), timeout=30) as client:
            wait_for("the run to start", lambda: client.get_run(RUN_ID), timeout=600, every=1)
            new, scaled_at, committed = drive_faults(project, client)
        [run_container] = project.containers("run")
        exit_code = subprocess.run(["docker", "wait", run_container], capture_output=True, text=True,
                                   timeout=900).stdout.strip()
        print(f"compose up to the end of the run: {time.monotonic() - start:.0f} s")
        assert exit_code == "0", project.compose("logs", "run", "coordinator")[-5000:]
        metrics, summary = read_run(project, tmp_path)
        steps = {int(m["step"]): m for m in metrics if "reward_mean" in m}
        # the restarted coordinator went on from the step committed before the restart, not from an older one
        resumed = re.findall(rf"resuming run {RUN_ID} at step (\d+)", project.compose("logs", "coordinator"))
        assert resumed and int(resumed[-1]) >= committed > scaled_at, (resumed, committed)
        # every step trained on its whole batch: no sample lost to the kill. A step the trainer applied while the
        # coordinator stopped is committed on resume as recovered (coordinator/runapi/recovery.py): its metrics
        # are lost.
        recovered = {int(m["step"]) for m in metrics if m.get("recovered")}
        assert recovered <= {int(resumed[-1])} and set(steps) | recovered == set(range(1, 81)), sorted(steps)
        assert {m["num_samples"] for m in steps.values()} == {SAMPLES_PER_STEP}
        check_replicas_served(steps, new, scaled_at)
        assert summary["heldout_accuracy_after"] - summary["heldout_accuracy_before"] >= 0.20, summary
    finally:
        subprocess.run(["docker", "compose", "-p", project.name, "--env-file", str(project.env_file),
                        "-f", str(COMPOSE), "down", "-v", "--remove-orphans"],
                       cwd=REPO, env=project.env, capture_output=True, timeout=300)
    assert project.running() == []
