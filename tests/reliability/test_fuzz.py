"""Property-based fuzzing of every RPC of every service, each a real process: malformed and extreme messages get
OK or a clear client-error status (never INTERNAL/UNKNOWN), no server dies or stops serving, memory stays bounded.

Safety: the services run under a 4 GiB address-space limit; fields that name a network address or a file
path are drawn from 127.0.0.1 addresses and paths inside the test's own directory only, and raw-byte
requests to those methods are always unparseable.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import pickle
import resource
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings, strategies as st
from google.protobuf.descriptor import FieldDescriptor as FD

from meshrl.v1 import (common_pb2, coordinator_pb2, reference_pb2, reward_pb2, rollout_pb2,  # noqa: F401
                       trainer_pb2)

from tests.reliability.procs import REPO, run_config, with_addresses, write_config

pytestmark = pytest.mark.slow

MEMORY_LIMIT = 4 * 2**30                   # RLIMIT_AS of every fuzzed service process
RSS_GROWTH_LIMIT = 1536 * 2**20            # what one RPC's fuzzing may leave a process holding
MAX_MESSAGE_BYTES = 8 * 2**20
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND}
MODULES = {"coordinator": "coordinator", "trainer": "services.trainer", "rollout": "services.rollout",
           "reward": "services.reward", "reference": "services.reference"}
SERVICES = {"rollout": rollout_pb2.DESCRIPTOR.services_by_name["Rollout"],
            "reward": reward_pb2.DESCRIPTOR.services_by_name["Reward"],
            "reference": reference_pb2.DESCRIPTOR.services_by_name["Reference"],
            "trainer": trainer_pb2.DESCRIPTOR.services_by_name["Trainer"],
            "coordinator": coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"]}
METHODS = [(role, m.name) for role, service in SERVICES.items() for m in service.methods]
# Methods whose requests name addresses to dial or paths to write: never fed parseable random bytes.
GUARDED = {("trainer", "PushWeights"), ("trainer", "SaveCheckpoint"), ("trainer", "LoadCheckpoint"),
           ("trainer", "ExportHF"), ("coordinator", "StartRun")}
FUZZ = settings(max_examples=50, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


# --- the services -------------------------------------------------------------------------------------

def _limits() -> None:  # pragma: no cover - runs in the child before exec
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)    # die with the test
    except OSError:
        pass


class Service:
    def __init__(self, role: str, config: Path, log_dir: Path):
        self.role = role
        self.log_path = log_dir / f"{role}.log"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        self.proc = subprocess.Popen([sys.executable, "-m", MODULES[role], "--config", str(config), "--port", "0",
                                      "--server.max_message_bytes", str(MAX_MESSAGE_BYTES)],
                                     cwd=REPO, env=env, stdout=self.log_path.open("w"), stderr=subprocess.STDOUT,
                                     preexec_fn=_limits)
        self.address = ""

    def wait(self, timeout: float = 240.0) -> str:
        marker = f"meshrl {self.role} listening on "
        deadline = time.time() + timeout
        while time.time() < deadline:
            text = self.log_path.read_text()
            if marker in text:
                self.address = text.split(marker, 1)[1].split()[0]
                return self.address
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.role} exited {self.proc.returncode}:\n{text[-3000:]}")
            time.sleep(0.2)
        raise RuntimeError(f"{self.role} did not start")

    def rss(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0


@pytest.fixture(scope="module")
def mesh(arith_model_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    cfg = run_config(arith_model_path, root / "runs", run={"num_steps": 1})
    path = write_config(root / "run.yaml", cfg)
    services = {role: Service(role, path, root) for role in MODULES}
    try:
        for s in services.values():
            s.wait()
        addresses = {role: [s.address] for role, s in services.items()}
        channels = {role: grpc.insecure_channel(s.address, options=[
            ("grpc.max_send_message_length", 64 * 2**20), ("grpc.max_receive_message_length", 64 * 2**20)])
            for role, s in services.items()}
        yield {"services": services, "channels": channels, "root": root,
               "run_config": with_addresses(cfg, addresses), "rss": {r: s.rss() for r, s in services.items()}}
        for ch in channels.values():
            ch.close()
    finally:
        for s in services.values():
            s.proc.kill()
            s.proc.wait()


# --- messages -----------------------------------------------------------------------------------------

INT32 = st.one_of(st.sampled_from([0, 1, -1, 2, 7, 43, 44, 63, 64, 65, 4096, 2**31 - 1, -2**31]),
                  st.integers(-2**31, 2**31 - 1))
INT64 = st.one_of(INT32, st.sampled_from([2**63 - 1, -2**63]), st.integers(-2**63, 2**63 - 1))
UINT32 = st.one_of(st.sampled_from([0, 1, 2**32 - 1]), st.integers(0, 2**32 - 1))
FLOAT = st.one_of(st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5, 1e-45, 3.4e38, -3.4e38, math.inf, -math.inf,
                                   math.nan]), st.floats(width=32))
DOUBLE = st.one_of(FLOAT, st.floats())
TEXT = st.one_of(st.text(max_size=40), st.sampled_from(["", " ", "1+2=", "\x00", "é" * 64, "0" * 5000,
                                                        "package.module:function", "os:system"]))
BYTES = st.binary(max_size=64)

# Addresses and paths the services may be told to use: loopback and the test's directory only.
LOOPBACK = st.one_of(st.sampled_from(["", ":", "127.0.0.1", "127.0.0.1:", "127.0.0.1:0", "127.0.0.1:1",
                                      "127.0.0.1:99999", "127.0.0.1:-5", "[::1]:1", "127.0.0.1:1:2"]),
                     st.integers(1, 65535).map(lambda p: f"127.0.0.1:{p}"))
SAFE_NAME = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_-.", min_size=1, max_size=20).filter(
    lambda s: s not in (".", ".."))


VOCAB = 44                                 # the arith model's; ids past it are a client error
SHORT = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
TOKENS = st.one_of(SHORT, SHORT, SHORT, SHORT,
                   st.lists(st.integers(0, VOCAB - 1), min_size=60, max_size=90),      # past max_model_len
                   st.lists(INT32, max_size=8))
# Counts go past their limits (n <= 1024, ppo_epochs <= 64); weight buckets stay >= 1 KiB, since 1-byte
# buckets would only burn this shared machine's CPU.
BY_NAME = {
    "prompt_ids": TOKENS, "response_ids": TOKENS, "chosen_ids": TOKENS, "rejected_ids": TOKENS,
    "n": st.sampled_from([0, 1, 2, 4, 16, 1025, 2**31 - 1, -1, -2**31]),
    "max_tokens": st.sampled_from([0, 1, 6, 64, 10**6, 2**31 - 1, -1]),
    "ppo_epochs": st.sampled_from([0, 1, 2, 65, 2**31 - 1, -1, -2**31]),
    "mini_batch_size": st.sampled_from([0, 1, 2, 3, -1, 2**31 - 1]),
    "bucket_bytes": st.sampled_from([0, -1, 1024, 65536, 2**62]),
    "world_size": st.sampled_from([0, 1, 2, -1, 2**31 - 1]),
    "timeout_s": st.sampled_from([0.0, 0.1, -1.0, math.nan]),
    "seed": INT64, "temperature": FLOAT, "top_p": FLOAT,
    # Ragged rows (columnar payloads): row lengths and token values that often fit together, sometimes not.
    "lengths": st.lists(st.integers(-1, 8), max_size=6).map(lambda xs: struct.pack(f"<{len(xs)}i", *xs)),
    "values": TOKENS.map(lambda xs: struct.pack(f"<{len(xs)}i", *[max(-2**31, min(x, 2**31 - 1)) for x in xs])),
}


def _scalar(field):
    return {FD.TYPE_INT32: INT32, FD.TYPE_SINT32: INT32, FD.TYPE_SFIXED32: INT32, FD.TYPE_INT64: INT64,
            FD.TYPE_SINT64: INT64, FD.TYPE_SFIXED64: INT64, FD.TYPE_UINT32: UINT32, FD.TYPE_FIXED32: UINT32,
            FD.TYPE_UINT64: st.integers(0, 2**64 - 1), FD.TYPE_FIXED64: st.integers(0, 2**64 - 1),
            FD.TYPE_FLOAT: FLOAT, FD.TYPE_DOUBLE: DOUBLE, FD.TYPE_BOOL: st.booleans(), FD.TYPE_STRING: TEXT,
            FD.TYPE_BYTES: BYTES}[field.type]


@st.composite
def message(draw, descriptor, depth: int = 3, overrides: dict | None = None):
    """A message of `descriptor` with any subset of its fields set to ordinary, boundary or absurd values."""
    cls = _class(descriptor)
    msg = cls()
    overrides = overrides or {}
    for field in descriptor.fields:
        if field.name in overrides:
            strategy = overrides[field.name]
        elif draw(st.integers(0, 3)) == 0:       # each field set three times in four
            continue
        elif field.name in BY_NAME and field.type != FD.TYPE_MESSAGE:   # TrainColumns.prompt_ids is a Ragged
            strategy = BY_NAME[field.name]
        elif field.type == FD.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
            key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            strategy = st.dictionaries(_scalar(key), _scalar(value), max_size=4)
        elif field.type == FD.TYPE_MESSAGE:
            if depth == 0:
                continue
            inner = message(field.message_type, depth - 1, overrides.get(f"{field.name}.*"))
            strategy = st.lists(inner, min_size=1, max_size=4) if field.is_repeated else inner
        elif field.type == FD.TYPE_ENUM:
            strategy = st.integers(-3, 12)
            strategy = st.lists(strategy, max_size=5) if field.is_repeated else strategy
        elif field.is_repeated:
            # Mostly short; sometimes long enough to cross batch and length limits.
            strategy = st.one_of(st.lists(_scalar(field), max_size=8),
                                 st.integers(60, 5000).map(lambda n, f=field: [_filler(f)] * n))
        else:
            strategy = _scalar(field)
        value = draw(strategy)
        target = getattr(msg, field.name)
        if field.type == FD.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
            target.update(value)
        elif field.type == FD.TYPE_MESSAGE and field.is_repeated:
            target.extend(value)
        elif field.type == FD.TYPE_MESSAGE:
            target.CopyFrom(value)
        elif field.is_repeated:
            target.extend(value)
        else:
            setattr(msg, field.name, value)
    return msg


def _filler(field):
    return {FD.TYPE_STRING: "x", FD.TYPE_BYTES: b"x", FD.TYPE_BOOL: True}.get(field.type, 1)


def _class(descriptor):
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(descriptor)


def _run_configs(base: dict, root: Path):
    """StartRun configs: random text, and the working config with one key set to an odd or absurd value."""
    keys = {("rollout", "n"): st.sampled_from([0, -1, 1, 2**31, 10**12, "x", None]),
            ("rollout", "temperature"): st.sampled_from([-1.0, math.nan, math.inf, 1e308, "hot"]),
            ("rollout", "max_tokens"): st.sampled_from([0, -3, 2**40]),
            ("data", "rollout_batch_size"): st.sampled_from([0, -1, 10**9, 1.5]),
            ("data", "train_files"): st.sampled_from([[], ["/nonexistent.jsonl"], [str(root / "run.yaml")], "x"]),
            ("run", "num_steps"): st.sampled_from([0, -1, 10**18, "many"]),
            ("model", "path"): st.sampled_from(["", "/nonexistent", str(root)]),
            ("algorithm", "adv_estimator"): st.sampled_from(["grpo", "bogus", 3]),
            ("algorithm", "clip_ratio_c"): st.sampled_from([0.5, -1.0, math.nan]),
            ("bogus_section", "x"): st.just(1)}

    def mutate(pair):
        (section, key), value = pair
        cfg = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
        cfg["run"] = {**cfg["run"], "run_dir": str(root / "runs"), "num_steps": 1}
        cfg[section] = {**cfg.get(section, {}), key: value}
        return yaml.safe_dump(cfg)

    mutated = st.sampled_from(sorted(keys)).flatmap(lambda k: keys[k].map(lambda v: (k, v))).map(mutate)
    return st.one_of(TEXT, mutated, st.sampled_from(["{", "- - -", "run: [", "a: b: c", "!!python/object:os.system"]))


class _Crafted:
    """A pickle that would create its marker file when unpickled by an unrestricted loader."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _rewrite_manifest(ck: Path) -> None:
    """What a crafter can do too: a manifest that matches the crafted files."""
    from isal import isal_zlib
    files = {str(f.relative_to(ck)): {"bytes": f.stat().st_size, "crc32": isal_zlib.crc32(f.read_bytes())}
             for f in ck.rglob("*") if f.is_file() and f.name != "manifest.json"}
    (ck / "manifest.json").write_text(json.dumps({"files": files}))


def _checkpoint_paths(mesh) -> list[str]:
    """Paths that exist as files, lie under a file, or hold a truncated, flipped, unfinished or crafted checkpoint
    (made once from a real save)."""
    if "checkpoint_paths" not in mesh:
        root = mesh["root"] / "ckfaults"
        good = root / "good"
        root.mkdir()
        code, details = _call(mesh["channels"]["trainer"], "trainer", "SaveCheckpoint",
                              trainer_pb2.CheckpointRequest(path=str(good)).SerializeToString())
        assert code == grpc.StatusCode.OK, details
        (root / "file").write_text("x")
        damaged = {name: Path(shutil.copytree(good, root / name)) for name in ("truncated", "flipped", "unfinished",
                                                                              "crafted", "dcp_is_a_file")}
        shard = next((damaged["truncated"] / "dcp").glob("*.distcp"))
        os.truncate(shard, shard.stat().st_size // 2)
        shard = next((damaged["flipped"] / "dcp").glob("*.distcp"))
        shard.write_bytes(bytes([shard.read_bytes()[0] ^ 0xFF]) + shard.read_bytes()[1:])
        (damaged["unfinished"] / "manifest.json").unlink()
        (damaged["crafted"] / "dcp" / ".metadata").write_bytes(pickle.dumps(_Crafted(mesh["root"] / "PWNED")))
        _rewrite_manifest(damaged["crafted"])
        shutil.rmtree(damaged["dcp_is_a_file"] / "dcp")
        (damaged["dcp_is_a_file"] / "dcp").write_text("x")
        mesh["checkpoint_paths"] = [str(root / "file"), str(root / "file" / "sub"), str(root / "file" / "a" / "b"),
                                    *map(str, damaged.values())]
    return mesh["checkpoint_paths"]


def _overrides(role: str, method: str, mesh) -> dict:
    root = mesh["root"]
    paths = st.one_of(st.just(""), SAFE_NAME.map(lambda n: str(root / "ckpt" / n)))
    if role == "trainer" and method in ("SaveCheckpoint", "LoadCheckpoint", "ExportHF"):
        paths = st.one_of(paths, st.sampled_from(_checkpoint_paths(mesh)))
    if (role, method) == ("trainer", "PushWeights"):
        return {"targets": st.lists(LOOPBACK, max_size=4)}
    if role == "trainer" and method in ("SaveCheckpoint", "LoadCheckpoint", "ExportHF"):
        return {"path": paths}
    if (role, method) == ("coordinator", "StartRun"):
        return {"config": _run_configs(mesh["run_config"], root), "run_id": st.one_of(st.just(""), SAFE_NAME)}
    return {}


def _request(role: str, method_name: str, mesh):
    """A strategy of (serialized request bytes or stream of them) for one method."""
    method = SERVICES[role].methods_by_name[method_name]
    cls = _class(method.input_type)
    structured = message(method.input_type, overrides=_overrides(role, method_name, mesh)).map(
        lambda m: m.SerializeToString())
    raw = BYTES
    if (role, method_name) in GUARDED:
        raw = BYTES.map(lambda b: b if _unparseable(cls, b) else b"\xff\xff\xff\xff")
    one = st.one_of(structured, structured, raw)
    if method.client_streaming:
        return st.lists(one, max_size=4)
    return one


def _unparseable(cls, data: bytes) -> bool:
    try:
        cls.FromString(data)
    except Exception:  # noqa: BLE001
        return True
    return False


def _call(channel, role: str, method_name: str, payload, timeout: float = 120.0):
    method = SERVICES[role].methods_by_name[method_name]
    path = f"/{SERVICES[role].full_name}/{method_name}"
    ident = dict(request_serializer=None, response_deserializer=None)
    try:
        if method.client_streaming:
            channel.stream_unary(path, **ident)(iter(payload), timeout=timeout)
        elif method.server_streaming:
            for i, _ in enumerate(channel.unary_stream(path, **ident)(payload, timeout=5.0)):
                if i >= 3:
                    break
        else:
            channel.unary_unary(path, **ident)(payload, timeout=timeout)
    except grpc.RpcError as e:
        if method.server_streaming and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return grpc.StatusCode.OK, ""          # a stream that follows a live run until our deadline
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def _serving(channel) -> bool:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _stop_runs(mesh) -> None:
    channel = mesh["channels"]["coordinator"]
    stub = __import__("meshrl.v1.coordinator_pb2_grpc", fromlist=["x"]).CoordinatorStub(channel)
    for run in stub.ListRuns(coordinator_pb2.ListRunsRequest(), timeout=30).runs:
        if run.state in (coordinator_pb2.RUN_STATE_RUNNING, coordinator_pb2.RUN_STATE_PAUSED,
                         coordinator_pb2.RUN_STATE_PENDING):
            try:
                stub.StopRun(coordinator_pb2.RunRequest(run_id=run.run_id), timeout=30)
            except grpc.RpcError:
                pass


# --- the tests ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("role,method", METHODS, ids=[f"{r}.{m}" for r, m in METHODS])
def test_every_rpc_answers_fuzzed_requests_with_ok_or_a_clear_client_error_and_keeps_serving(mesh, role, method):
    channel = mesh["channels"][role]
    service = mesh["services"][role]
    seen: list[tuple[grpc.StatusCode, str]] = []

    @FUZZ
    @given(payload=_request(role, method, mesh))
    def fuzz(payload):
        code, details = _call(channel, role, method, payload)
        seen.append((code, details))
        assert code in ALLOWED, f"{role}.{method} answered {code.name}: {details[:500]}"
        if code != grpc.StatusCode.OK:
            assert details, f"{role}.{method}: {code.name} without a message"

    try:
        fuzz()
    finally:
        if role == "coordinator":
            _stop_runs(mesh)
    assert service.proc.poll() is None, f"{role} died:\n{service.log_path.read_text()[-3000:]}"
    assert not (mesh["root"] / "PWNED").exists(), "a crafted checkpoint ran its pickle payload"
    assert _serving(channel)
    assert service.rss() - mesh["rss"][role] < RSS_GROWTH_LIMIT
    assert any(code != grpc.StatusCode.OK for code, _ in seen)          # the fuzzing reached the checks


@pytest.mark.parametrize("role", list(SERVICES))
def test_a_message_over_the_size_limit_is_resource_exhausted_and_the_server_keeps_serving(mesh, role):
    method = SERVICES[role].methods[0]
    code, details = _call(mesh["channels"][role], role, method.name,
                          [b"\x0a" + b"\xff" * 9 * 2**20] if method.client_streaming else
                          b"\x0a" + b"\xff" * 9 * 2**20)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
    assert _serving(mesh["channels"][role])


# --- limits, probed directly --------------------------------------------------------------------------

def _valid_train_sample():
    return trainer_pb2.TrainSample(prompt_ids=[1, 5, 14, 6, 16], response_ids=[7, 2], advantages=[1.0, 1.0],
                                   old_logprobs=[-1.0, -1.0])


def _peak_rss(service: Service) -> int:
    for line in Path(f"/proc/{service.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def test_limits_a_generate_with_an_absurd_sample_count_is_refused_before_it_takes_the_memory(mesh):
    rollout = mesh["services"]["rollout"]
    peak = _peak_rss(rollout)
    request = rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(id="p", prompt_ids=[1, 5, 14, 6, 16])],
                                          sampling=rollout_pb2.SamplingParams(n=2**31 - 1, max_tokens=4))
    code, details = _call(mesh["channels"]["rollout"], "rollout", "Generate", request.SerializeToString(),
                          timeout=30)
    assert _serving(mesh["channels"]["rollout"])
    assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), (code, details)
    assert _peak_rss(rollout) - peak < 256 * 2**20          # refused by a limit, not by running out


def test_limits_a_train_actor_with_an_absurd_epoch_count_is_refused_quickly(mesh):
    # Last of the module: when it is not refused, the trainer stays busy until the fixture kills it.
    request = trainer_pb2.TrainActorRequest(samples=[_valid_train_sample()],
                                            loss=trainer_pb2.ActorLoss(ppo_epochs=2**31 - 1, policy_loss_settings=(
                                                '{"clip_ratio_low": 0.2, "clip_ratio_high": 0.2}')))
    code, details = _call(mesh["channels"]["trainer"], "trainer", "TrainActor", request.SerializeToString(),
                          timeout=10)
    assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), (code, details)
