"""Security: bearer tokens on every RPC but health, TLS and mutual TLS, loopback binding, no secret in logs
or metrics, and user reward code loaded only from the configured module paths."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.client import Client
from coordinator.runapi.service import CoordinatorSettings, start as start_coordinator
from meshrl.v1 import coordinator_pb2, reference_pb2, reward_pb2, reward_pb2_grpc, rollout_pb2, trainer_pb2
from services.common.rpc.channel import ClientTLS, set_default_tls
from services.common.config import load_config
from services.local import start_local_mesh

from tests.reliability.certs import CA
from tests.reliability.procs import REPO, Procs, run_config, wait_until, write_config

pytestmark = pytest.mark.slow

SERVICES = {"rollout": rollout_pb2.DESCRIPTOR.services_by_name["Rollout"],
            "reward": reward_pb2.DESCRIPTOR.services_by_name["Reward"],
            "reference": reference_pb2.DESCRIPTOR.services_by_name["Reference"],
            "trainer": trainer_pb2.DESCRIPTOR.services_by_name["Trainer"],
            "coordinator": coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"]}


def _code(channel, service, method, metadata=()) -> grpc.StatusCode:
    """Status of calling `method` with an empty request (streams: one empty message)."""
    path = f"/{service.full_name}/{method.name}"
    ident = dict(request_serializer=None, response_deserializer=None)
    try:
        if method.client_streaming:
            channel.stream_unary(path, **ident)(iter([b""]), metadata=metadata, timeout=30)
        elif method.server_streaming:
            for _ in channel.unary_stream(path, **ident)(b"", metadata=metadata, timeout=30):
                break
        else:
            channel.unary_unary(path, **ident)(b"", metadata=metadata, timeout=30)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def _health(channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=30).status


@pytest.fixture(scope="module")
def token_mesh(arith_model_path, tmp_path_factory):
    """Every service as a process, each requiring the bearer token (given through the environment)."""
    root = tmp_path_factory.mktemp("auth")
    token = f"tok-{uuid.uuid4().hex}"
    path = write_config(root / "run.yaml", run_config(arith_model_path, root / "runs"))
    os.environ["MESHRL_SERVER__AUTH_TOKEN"] = token
    try:
        procs = Procs(path, root / "logs")
        children = procs.start_all([(role, []) for role in SERVICES])
    finally:
        del os.environ["MESHRL_SERVER__AUTH_TOKEN"]
    try:
        yield token, {c.role: c for c in children}
    finally:
        procs.close()


@pytest.mark.parametrize("role", list(SERVICES))
def test_with_auth_on_every_rpc_but_health_needs_the_bearer_token(token_mesh, role):
    token, children = token_mesh
    service = SERVICES[role]
    with grpc.insecure_channel(children[role].address) as channel:
        assert _health(channel) == health_pb2.HealthCheckResponse.SERVING            # no token needed
        for method in service.methods:
            for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", token),),
                             (("authorization", f"Bearer {token}x"),)):
                assert _code(channel, service, method, metadata) == grpc.StatusCode.UNAUTHENTICATED, \
                    (method.name, metadata)
            good = _code(channel, service, method, (("authorization", f"Bearer {token}"),))
            assert good != grpc.StatusCode.UNAUTHENTICATED, method.name
            assert good not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), method.name
    assert token not in Procs.log(children[role])


# --- TLS ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca, rogue = CA(root / "ca"), CA(root / "rogue", name="rogue-ca")
    return {"ca": ca, "server": ca.issue("server"), "client": ca.issue("client"), "rogue": rogue.issue("client")}


def _reward_process(tmp_path: Path, server: dict, token: str | None = None) -> tuple[Procs, str]:
    cfg = {"server": server}
    if token:
        cfg["server"]["auth_token"] = token
    path = write_config(tmp_path / "reward.yaml", cfg)
    procs = Procs(path, tmp_path / "logs")
    return procs, procs.start("reward").address


def _get_info(address: str, tls: ClientTLS | None, token: str | None = None) -> grpc.StatusCode:
    if tls is None:
        channel = grpc.insecure_channel(address)
    else:
        channel = grpc.secure_channel(address, tls.credentials())
    with channel:
        try:
            reward_pb2_grpc.RewardStub(channel).GetInfo(
                __import__("meshrl.v1.common_pb2", fromlist=["x"]).GetInfoRequest(), timeout=10,
                metadata=(("authorization", f"Bearer {token}"),) if token else ())
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def test_tls_server_refuses_plaintext_and_unknown_authorities_and_serves_clients_that_trust_its_ca(pki, tmp_path):
    procs, address = _reward_process(tmp_path, {"tls_cert": pki["server"].cert, "tls_key": pki["server"].key})
    with procs:
        assert _get_info(address, ClientTLS.from_files(pki["ca"].pem)) == grpc.StatusCode.OK
        assert _get_info(address, None) == grpc.StatusCode.UNAVAILABLE                # plaintext
        rogue_ca = str(Path(pki["rogue"].cert).parent / "rogue-ca.pem")
        assert _get_info(address, ClientTLS.from_files(rogue_ca)) == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_needs_a_client_certificate_from_the_configured_ca_and_the_token_on_top(pki, tmp_path):
    token = f"tok-{uuid.uuid4().hex}"
    procs, address = _reward_process(tmp_path, {"tls_cert": pki["server"].cert, "tls_key": pki["server"].key,
                                                "tls_client_ca": pki["ca"].pem}, token=token)
    with procs:
        good = ClientTLS.from_files(pki["ca"].pem, pki["client"].cert, pki["client"].key)
        assert _get_info(address, good, token) == grpc.StatusCode.OK
        assert _get_info(address, good) == grpc.StatusCode.UNAUTHENTICATED            # certificate, no token
        assert _get_info(address, good, "wrong") == grpc.StatusCode.UNAUTHENTICATED
        no_cert = ClientTLS.from_files(pki["ca"].pem)
        assert _get_info(address, no_cert, token) == grpc.StatusCode.UNAVAILABLE      # no client certificate
        rogue = ClientTLS.from_files(pki["ca"].pem, pki["rogue"].cert, pki["rogue"].key)
        assert _get_info(address, rogue, token) == grpc.StatusCode.UNAVAILABLE        # another CA's
        assert _get_info(address, None, token) == grpc.StatusCode.UNAVAILABLE
        assert token not in Procs.log(procs.launcher.children[0])


def test_tls_settings_that_do_not_fit_fail_at_start_naming_the_key(pki, tmp_path):
    for server, key in (({"tls_cert": pki["server"].cert}, "tls_key"),
                        ({"tls_cert": str(tmp_path / "missing.pem"), "tls_key": pki["server"].key},
                         "server.tls_cert"),
                        ({"tls_client_ca": pki["ca"].pem}, "tls_client_ca")):
        path = write_config(tmp_path / "bad.yaml", {"server": server})
        result = subprocess.run([sys.executable, "-m", "services.reward", "--config", str(path), "--port", "0"],
                                cwd=REPO, capture_output=True, text=True, timeout=120)
        assert result.returncode != 0
        assert key in result.stderr + result.stdout, (key, result.stderr[-1000:])


def test_a_whole_mesh_trains_over_mutual_tls_with_the_token(arith_model_path, tmp_path, pki):
    token = f"tok-{uuid.uuid4().hex}"
    tls = {"tls_cert": pki["server"].cert, "tls_key": pki["server"].key, "tls_client_ca": pki["ca"].pem,
           "tls_ca": pki["ca"].pem, "auth_token": token}
    cfg = run_config(arith_model_path, tmp_path / "runs", run={"num_steps": 2}, server=tls)

    async def main():
        mesh = await start_local_mesh(cfg, num_rollout=1)
        settings = load_config(CoordinatorSettings, data={"server": tls})
        server, port, engine = await start_coordinator(settings, "127.0.0.1:0")
        client = Client(f"127.0.0.1:{port}", token=token,
                        tls=ClientTLS.from_files(pki["ca"].pem, pki["client"].cert, pki["client"].key))
        try:
            run_id = await asyncio.to_thread(client.start_run, yaml.safe_dump(mesh.config))
            final = await asyncio.to_thread(client.wait, run_id)
            assert final.state == "COMPLETED", final.message
            # Weights reached the replica over TLS too (the trainer pushes them itself).
            assert final.weight_version == 2
            services = await asyncio.to_thread(client.list_services, run_id)
            assert all(r.healthy for r in services)
            plain = Client(f"127.0.0.1:{port}", token=token)
            with pytest.raises(grpc.RpcError) as err:
                await asyncio.to_thread(plain.list_runs)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            plain.close()
        finally:
            client.close()
            await engine.close()
            await server.stop(0)
            await mesh.stop()
            set_default_tls(None)

    asyncio.run(main())


# --- meshrl up ----------------------------------------------------------------------------------------

def _listening(pid: int) -> list[str]:
    """Local addresses of the TCP sockets process `pid` listens on (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            parts = line.split()
            if parts[3] == "0A" and parts[9] in inodes:           # 0A = LISTEN
                host, port = parts[1].split(":")
                # /proc prints each 32-bit word of the address in host (little-endian) byte order.
                raw = b"".join(bytes.fromhex(host[i:i + 8])[::-1] for i in range(0, len(host), 8))
                ip = ipaddress.ip_address(raw)
                if ip.version == 6 and ip.ipv4_mapped:
                    ip = ip.ipv4_mapped
                out.append(f"{ip}:{int(port, 16)}")
    return out


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def test_meshrl_up_binds_loopback_only_and_no_secret_reaches_logs_or_metrics(arith_model_path, tmp_path):
    token = f"tok-{uuid.uuid4().hex}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MESHRL_SERVER__AUTH_TOKEN": token}
    proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "up", "examples/arith/grpo.yaml",
                             "--run-dir", str(tmp_path), "--model.path", arith_model_path, "--run.num_steps", "3",
                             "--data.heldout_size", "8", "--data.rollout_batch_size", "4"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sockets: dict[int, list[str]] = {}
    cmdlines: dict[int, str] = {}
    try:
        def all_listening():
            kids = _children(proc.pid)
            for kid in kids:
                try:
                    sockets[kid] = _listening(kid)
                    cmdlines[kid] = Path(f"/proc/{kid}/cmdline").read_text()
                except OSError:
                    pass
            return len(kids) >= 6 and all(sockets.get(k) for k in kids)

        wait_until(all_listening, 300, "every service of `meshrl up` to listen", interval=0.5)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    addresses = [a for kid in sockets for a in sockets[kid]]
    assert len(sockets) >= 6 and addresses
    assert all(a.startswith("127.0.0.1:") for a in addresses), addresses
    assert token not in out
    assert len(cmdlines) >= 6 and all(token not in c for c in cmdlines.values())   # not in `ps` either
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "metrics.jsonl" for p in files) and any(p.suffix == ".log" for p in files)
    for p in files:
        assert token.encode() not in p.read_bytes(), p


# --- user reward code --------------------------------------------------------------------------------

def test_user_reward_code_is_imported_only_from_the_configured_module_path(tmp_path, monkeypatch):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    marker = tmp_path / "imported"
    (plugins / "sneaky_reward.py").write_text(
        # Appends: the service and each of its worker processes import it, possibly while the test reads.
        f"with open({str(marker)!r}, 'a') as f:\n    f.write('imported')\n"
        "def score(*, prompt, response, response_ids, ground_truth, data_source):\n    return 0.5\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(plugins), os.environ.get("PYTHONPATH")])))
    procs, address = _reward_process(tmp_path, {})
    with procs, grpc.insecure_channel(address) as channel:
        stub = reward_pb2_grpc.RewardStub(channel)
        names = ["sneaky_reward", "sneaky_reward:score", "os:system", "tests.fixtures.reward_user_fns"]
        # Scored by a built-in named in the request (the default reward refuses data sources it does not know).
        reply = stub.Score(reward_pb2.ScoreRequest(items=[
            reward_pb2.ScoreItem(id=n, prompt=n, response=n, ground_truth="1", data_source=n) for n in names],
            components=[reward_pb2.RewardComponent(name="exact_match", weight=1.0)]), timeout=30)
        assert [dict(r.components) for r in reply.results] == [{"exact_match": 0.0}] * len(names)
        assert not marker.exists()                                         # requests name no code to load
    # Configured, the same module is what scores.
    path = write_config(tmp_path / "configured.yaml", {"reward": {"function": "sneaky_reward:score"}})
    procs = Procs(path, tmp_path / "logs2")
    with procs, grpc.insecure_channel(procs.start("reward").address) as channel:
        reply = reward_pb2_grpc.RewardStub(channel).Score(reward_pb2.ScoreRequest(items=[
            reward_pb2.ScoreItem(id="x", response="1", ground_truth="1")]), timeout=60)
        assert reply.results[0].score == 0.5 and "imported" in marker.read_text()
