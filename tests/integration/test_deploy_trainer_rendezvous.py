"""The Kubernetes trainer command (deploy/k8s/trainer.yaml) run as two local "nodes" over c10d: global rank 0,
the rank that serves gRPC, lands on the head pod even when a worker pod joins the rendezvous first."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_deploy import REPO, kustomization, render_k8s

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent


def free_port() -> int:
    # Only for the rendezvous endpoint: both nodes must be told it before either starts.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command and args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], value)


def healthy(port: int) -> bool:
    check = [sys.executable, "-m", "services.common.rpc.healthcheck", f"127.0.0.1:{port}", "--timeout", "1"]
    return subprocess.run(check, capture_output=True, timeout=30).returncode == 0


def wait_until_serving(port: int, procs: dict[str, subprocess.Popen], logs: dict[str, Path]) -> None:
    """Until the trainer answers health checks; fails with the log of a node that exited meanwhile."""
    for _ in range(90):                # a bound on health checks, not a timing assertion
        if healthy(port):
            return
        for name, p in procs.items():
            assert p.poll() is None, f"{name} exited:\n{logs[name].read_text()[-3000:]}"
        time.sleep(1.0)
    raise AssertionError("trainer never served")


def wait_for_line(log: Path, text: str, proc: subprocess.Popen) -> str:
    """The log once it holds `text` (a progress event of that node); fails if the node exits first."""
    for _ in range(1200):              # a bound on polls, not a timing assertion
        content = log.read_text() if log.exists() else ""
        if text in content:
            return content
        assert proc.poll() is None, f"{log.name}: exited before {text!r}:\n{content[-3000:]}"
        time.sleep(0.1)
    raise AssertionError(f"{log.name}: never logged {text!r}")


def stop(procs: dict[str, subprocess.Popen]) -> None:
    """SIGTERM to every node, then SIGKILL to whatever of its session is left after 15 s."""
    for p in procs.values():
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs.values():
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(p.pid, signal.SIGKILL)       # torchrun and its ranks share its session
        except ProcessLookupError:
            pass
        p.wait()


def test_the_k8s_trainer_command_puts_rank_0_on_trainer_0_even_when_a_worker_joins_first(arith_model_path, tmp_path):
    namespace = kustomization()["namespace"]
    sets = {o["metadata"]["name"]: o for o in render_k8s() if o["kind"] == "StatefulSet"}
    head, worker = sets["trainer"], sets["trainer-worker"]
    governing = head["spec"]["serviceName"]
    pods = {"trainer-0": head, "trainer-worker-0": worker}
    # Pod DNS names become loopback addresses in the same sort order (c10d ranks nodes by sorted address).
    names = sorted(pods)
    assert names[0] == "trainer-0"
    address = {name: f"127.0.0.{i + 2}" for i, name in enumerate(names)}
    rdzv_port = free_port()
    procs: dict[str, subprocess.Popen] = {}
    logs = {name: tmp_path / f"{name}.log" for name in pods}
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("MESHRL_")}
    try:
        for name in ("trainer-worker-0", "trainer-0"):          # the worker first
            container = pods[name]["spec"]["template"]["spec"]["containers"][0]
            env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
            num_nodes = int(env["TRAINER_NNODES"])
            assert num_nodes == head["spec"]["replicas"] + worker["spec"]["replicas"]
            env.update(POD_NAME=name, TRAINER_NPROC_PER_NODE="1",
                       # a CPU stand-in for each node's GPUs
                       MESHRL_MODEL__DEVICE="cpu", MESHRL_MODEL__DTYPE="float32",
                       MESHRL_ACTOR__DP_SIZE=str(num_nodes), MESHRL_SERVER__HOST="127.0.0.1",
                       MESHRL_SERVER__PORT="0", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                       LOGLEVEL="INFO")   # torchrun's elastic agent logs its rendezvous steps
            argv = [expand(a, env) for a in container["command"] + container["args"]]
            for pod in pods:
                argv = [a.replace(f"{pod}.{governing}.{namespace}.svc.cluster.local", address[pod]) for a in argv]
            argv = [a.replace(":29400", f":{rdzv_port}").replace("/etc/meshrl/run.yaml",
                                                                  str(REPO / "examples/arith/grpo.yaml"))
                    for a in argv]
            assert argv[0] == "torchrun" and f"--local_addr={address[name]}" in argv
            argv[0] = str(BIN / "torchrun")
            with logs[name].open("w") as log:
                procs[name] = subprocess.Popen(argv, env={**base_env, **env}, cwd=REPO, stdout=log,
                                               stderr=subprocess.STDOUT, start_new_session=True)
            if name == "trainer-worker-0":
                # The worker is in the rendezvous, and has not got through it, before the head starts.
                waiting = wait_for_line(logs[name], "Rendezvous'ing worker group", procs[name])
                assert "actor loaded" not in waiting
        # The head binds port 0 and says which port it got.
        served = wait_for_line(logs["trainer-0"], "meshrl trainer listening on 127.0.0.1:", procs["trainer-0"])
        grpc_port = int(re.search(r"meshrl trainer listening on 127\.0\.0\.1:(\d+)", served)[1])
        wait_until_serving(grpc_port, procs, logs)
        head_log, worker_log = logs["trainer-0"].read_text(), logs["trainer-worker-0"].read_text()
        assert f"meshrl trainer listening on 127.0.0.1:{grpc_port}" in head_log
        assert "listening on" not in worker_log
        assert "Rank 0: actor loaded" in head_log and "Rank 1: actor loaded" in worker_log
    finally:
        stop(procs)
