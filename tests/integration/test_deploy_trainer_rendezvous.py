"""The Kubernetes trainer command (deploy/k8s/trainer.yaml) run as two local "nodes" over c10d: global rank 0,
the rank that serves gRPC, lands on the head pod even when a worker pod joins the rendezvous first."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import ports
from tests.integration.test_deploy import REPO, kustomization, render_k8s

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent


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


def wait_for_line(log: Path, text: str, proc: subprocess.Popen, port: int | None = None) -> str:
    """The log once it holds `text` (a progress event of that node); fails if the node exits first (PortInUse when
    it exited because the rendezvous `port` was in use)."""
    for _ in range(1200):              # a bound on polls, not a timing assertion
        content = log.read_text() if log.exists() else ""
        if text in content:
            return content
        if proc.poll() is not None and port is not None and ports.in_use(content):
            raise ports.PortInUse(port)
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


class Nodes:
    """The two trainer pods of deploy/k8s as local processes, each on its own loopback address."""

    def __init__(self, tmp_path: Path):
        self.namespace = kustomization()["namespace"]
        sets = {o["metadata"]["name"]: o for o in render_k8s() if o["kind"] == "StatefulSet"}
        self.head, self.worker = sets["trainer"], sets["trainer-worker"]
        self.governing = self.head["spec"]["serviceName"]
        self.pods = {"trainer-0": self.head, "trainer-worker-0": self.worker}
        # Pod DNS names become loopback addresses in the same sort order (c10d ranks nodes by sorted address).
        names = sorted(self.pods)
        assert names[0] == "trainer-0"
        self.address = {name: f"127.0.0.{i + 2}" for i, name in enumerate(names)}
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs = {name: tmp_path / f"{name}.log" for name in self.pods}
        self.base_env = {k: v for k, v in os.environ.items() if not k.startswith("MESHRL_")}

    def launch(self, name: str, rdzv_port: int) -> None:
        container = self.pods[name]["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        num_nodes = int(env["TRAINER_NNODES"])
        assert num_nodes == self.head["spec"]["replicas"] + self.worker["spec"]["replicas"]
        env.update(POD_NAME=name, TRAINER_NPROC_PER_NODE="1",
                   # a CPU stand-in for each node's GPUs
                   MESHRL_MODEL__DEVICE="cpu", MESHRL_MODEL__DTYPE="float32",
                   MESHRL_ACTOR__DP_SIZE=str(num_nodes), MESHRL_SERVER__HOST="127.0.0.1",
                   MESHRL_SERVER__PORT="0", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                   LOGLEVEL="INFO")   # torchrun's elastic agent logs its rendezvous steps
        argv = [expand(a, env) for a in container["command"] + container["args"]]
        for pod in self.pods:
            argv = [a.replace(f"{pod}.{self.governing}.{self.namespace}.svc.cluster.local", self.address[pod])
                    for a in argv]
        argv = [a.replace(":29400", f":{rdzv_port}").replace("/etc/meshrl/run.yaml",
                                                              str(REPO / "examples/arith/grpo.yaml"))
                for a in argv]
        assert argv[0] == "torchrun" and f"--local_addr={self.address[name]}" in argv
        argv[0] = str(BIN / "torchrun")
        with self.logs[name].open("w") as log:
            self.procs[name] = subprocess.Popen(argv, env={**self.base_env, **env}, cwd=REPO, stdout=log,
                                                stderr=subprocess.STDOUT, start_new_session=True)

    def start(self, rdzv_port: int) -> str:
        """Both nodes on rendezvous port `rdzv_port`, the worker first; the head's log once it serves. The
        rendezvous store (torch's TCPStore, on the head) takes a port given before either node starts: a bind
        that met a port in use stops both and tries another (tests/ports.py)."""
        self.launch("trainer-worker-0", rdzv_port)
        # The worker is in the rendezvous, and has not got through it, before the head starts.
        waiting = wait_for_line(self.logs["trainer-worker-0"], "Rendezvous'ing worker group",
                                self.procs["trainer-worker-0"])
        assert "actor loaded" not in waiting
        self.launch("trainer-0", rdzv_port)
        try:
            # The head binds port 0 and says which port it got.
            return wait_for_line(self.logs["trainer-0"], "meshrl trainer listening on 127.0.0.1:",
                                 self.procs["trainer-0"], port=rdzv_port)
        except ports.PortInUse:
            stop(self.procs)
            raise


def test_the_k8s_trainer_command_puts_rank_0_on_trainer_0_even_when_a_worker_joins_first(arith_model_path, tmp_path):
    nodes = Nodes(tmp_path)
    procs, logs = nodes.procs, nodes.logs
    try:
        served = ports.start_on_a_port(nodes.start)
        grpc_port = int(re.search(r"meshrl trainer listening on 127\.0\.0\.1:(\d+)", served)[1])
        wait_until_serving(grpc_port, procs, logs)
        head_log, worker_log = logs["trainer-0"].read_text(), logs["trainer-worker-0"].read_text()
        assert f"meshrl trainer listening on 127.0.0.1:{grpc_port}" in head_log
        assert "listening on" not in worker_log
        assert "Rank 0: actor loaded" in head_log and "Rank 1: actor loaded" in worker_log
    finally:
        stop(procs)
