"""The `meshrl` CLI over mutual TLS (flags or the services' MESHRL_SERVER__TLS_* variables): run, pause, status,
services, resume, watch and stop against a coordinator that speaks TLS only; TLS options that cannot be used are
refused by the name the user gave them."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from coordinator.client import Client
from services.common.rpc.channel import ClientTLS

from tests.reliability.certs import CA
from tests.reliability.procs import REPO, Procs, run_config, wait_until, with_addresses, write_config

NUM_STEPS = 30


def meshrl(*args, env=None):
    return subprocess.run([sys.executable, "-m", "coordinator.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200", **(env or {})})


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    ca = CA(tmp_path_factory.mktemp("pki") / "ca")
    return {"ca": ca.pem, "server": ca.issue("server"), "client": ca.issue("client")}


@pytest.mark.slow
def test_the_cli_drives_a_run_on_a_mutual_tls_coordinator_with_flags_or_environment(arith_model_path, tmp_path, pki):
    tls = {"tls_cert": pki["server"].cert, "tls_key": pki["server"].key, "tls_client_ca": pki["ca"],
           "tls_ca": pki["ca"]}
    cfg = run_config(arith_model_path, tmp_path / "runs", run={"num_steps": NUM_STEPS}, server=tls)
    path = write_config(tmp_path / "run.yaml", cfg)
    flags = ["--tls-ca", pki["ca"], "--tls-cert", pki["client"].cert, "--tls-key", pki["client"].key]
    env = {"MESHRL_SERVER__TLS_CA": pki["ca"], "MESHRL_SERVER__TLS_CLIENT_CERT": pki["client"].cert,
           "MESHRL_SERVER__TLS_CLIENT_KEY": pki["client"].key}
    with Procs(path, tmp_path / "logs") as procs:
        children = procs.start_all([("trainer", []), ("reward", []), ("rollout", []), ("coordinator", [])])
        addresses = {c.role: [c.address] for c in children}
        at = ["--coordinator", addresses["coordinator"][0]]
        recipe = write_config(tmp_path / "recipe.yaml", with_addresses(cfg, addresses))

        plain = meshrl("status", *at)
        assert plain.returncode == 1 and plain.stderr.startswith("meshrl status: UNAVAILABLE: "), plain.stderr
        no_cert = meshrl("status", *at, "--tls-ca", pki["ca"])      # mutual TLS wants a client certificate
        assert no_cert.returncode == 1 and no_cert.stderr.startswith("meshrl status: UNAVAILABLE: ")

        started = meshrl("run", str(recipe), "--no-follow", *at, *flags)
        assert started.returncode == 0, started.stderr
        run_id = started.stdout.strip()
        client = Client(addresses["coordinator"][0],
                        tls=ClientTLS.from_files(pki["ca"], pki["client"].cert, pki["client"].key))
        wait_until(lambda: client.get_run(run_id).step >= 1, 300, "the first step")
        # A stopped trainer holds the run inside its current step, so the pause is asked mid-step, whatever
        # the speed of the steps.
        trainer = children[0].proc.pid
        os.kill(trainer, signal.SIGSTOP)
        try:
            paused = meshrl("pause", run_id, *at, env=env)
        finally:
            os.kill(trainer, signal.SIGCONT)
        assert paused.returncode == 0, paused.stderr
        asked = re.fullmatch(rf"run {run_id} pauses after its current step \(steps done: (\d+)/{NUM_STEPS}\); "
                             rf"`meshrl resume` continues it\n", paused.stdout)
        assert asked, paused.stdout
        status = wait_until(lambda: (s := client.get_run(run_id)).state == "PAUSED" and s, 120, "PAUSED")
        assert status.step in (int(asked[1]), int(asked[1]) + 1)      # after the step in flight, if one was
        shown = meshrl("status", run_id, *at, env=env)
        assert shown.returncode == 0 and f"{run_id}" in shown.stdout and "PAUSED" in shown.stdout, shown.stdout
        services = meshrl("services", run_id, *at, *flags)
        assert services.returncode == 0 and addresses["rollout"][0] in services.stdout, services.stdout

        resumed = meshrl("resume", run_id, *at, *flags)
        assert (resumed.returncode, resumed.stdout) == (0, f"run {run_id} RUNNING at step {status.step}/{NUM_STEPS}\n")
        watched = meshrl("watch", run_id, *at, env=env)
        assert watched.returncode == 0, watched.stderr
        assert watched.stdout.endswith(f"{run_id}: COMPLETED at step {NUM_STEPS}/{NUM_STEPS}\n"), watched.stdout
        stopped = meshrl("stop", run_id, *at, *flags)
        assert (stopped.returncode, stopped.stderr) == (
            2, f"meshrl stop: FAILED_PRECONDITION: run '{run_id}' is COMPLETED; cannot stop\n")
        client.close()


@pytest.mark.parametrize("args, env, line", [
    (["--tls-cert", "c.pem"], {}, "--tls-cert and --tls-key: set both or neither"),
    (["--tls-cert", "c.pem", "--tls-key", "k.pem"], {},
     "--tls-cert: needs --tls-ca as well (TLS trusts the CA that signs the coordinator's certificate)"),
    (["--tls-ca", "/nonexistent/ca.pem"], {}, "--tls-ca: file '/nonexistent/ca.pem' does not exist"),
    ([], {"MESHRL_SERVER__TLS_CA": "/nonexistent/ca.pem"},
     "MESHRL_SERVER__TLS_CA: file '/nonexistent/ca.pem' does not exist"),
    (["--tls-server-name", "mesh"], {}, "--tls-server-name: needs --tls-ca as well (TLS trusts the CA that signs "
                                         "the coordinator's certificate)"),
])
def test_tls_options_that_cannot_be_used_are_refused_by_the_name_the_user_gave(args, env, line):
    for command in ("status", "pause", "resume"):
        run_id = [] if command == "status" else ["r1"]
        result = meshrl(command, *run_id, "--coordinator", "127.0.0.1:1", *args, env=env)
        assert (result.returncode, result.stderr) == (2, f"meshrl {command}: {line}\n")
