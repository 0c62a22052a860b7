"""Python client for scripts: `from coordinator.client import Client` drives runs over the run API.

Light on purpose: it imports grpcio, protobuf, pyyaml and the standard library only (no torch, numpy or pydantic),
so a script that starts and follows runs needs none of the services' dependencies (tests/unit/test_light_client.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import grpc
import yaml

from coordinator.mesh_address import find_coordinator
from meshrl.v1 import coordinator_pb2, coordinator_pb2_grpc
from services.common.rpc.grpc_config import MAX_MESSAGE_BYTES, ClientTLS, service_config

if TYPE_CHECKING:                       # the typed config, for readers and type checkers only: it needs pydantic
    from coordinator.recipe.config import RunConfig

STATE_NAMES = {v: k[len("RUN_STATE_"):] for k, v in coordinator_pb2.RunState.items()}


@dataclass
class RunStatus:
    run_id: str
    state: str
    step: int
    num_steps: int
    weight_version: int
    data_position: int
    checkpoint_path: str
    message: str
    run_dir: str
    last_metrics: dict[str, float] = field(default_factory=dict)
    # The effective config as YAML (docs/coordinator.md, "Run-scoped settings").
    config: str = ""
    # Its named adapter on the trainer when it runs beside other LoRA runs ("" = the trainer's run adapter).
    adapter: str = ""
    # "stop" or "pause" when asked for and landing after the step in flight; "" when none (or an older coordinator).
    pending_command: str = ""

    @property
    def finished(self) -> bool:
        return self.state in ("COMPLETED", "FAILED", "STOPPED")


@dataclass
class Replica:
    pool: str
    address: str
    healthy: bool
    weight_version: int
    load: int


def _status(pb: coordinator_pb2.RunStatus) -> RunStatus:
    return RunStatus(pb.run_id, STATE_NAMES[pb.state], pb.step, pb.num_steps, pb.weight_version, pb.data_position,
                     pb.checkpoint_path, pb.message, pb.run_dir, dict(pb.last_metrics), pb.config,
                     pb.adapter, pb.pending_command)


def _plain(value: Any) -> Any:
    if hasattr(value, "get_secret_value"):            # pydantic's SecretStr, without importing pydantic
        return value.get_secret_value()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def config_text(config: "RunConfig | dict | str | Path") -> str:
    """Run configs travel as YAML text; typed RunConfig objects and dicts are dumped to it."""
    if hasattr(config, "model_dump"):                 # a RunConfig (any pydantic model of the recipe)
        return yaml.safe_dump(_plain(config.model_dump(mode="python")), sort_keys=False)
    if isinstance(config, dict):
        return yaml.safe_dump(config, sort_keys=False)
    if isinstance(config, Path):
        return config.read_text()
    return config


class Client:
    """Blocking client of the Coordinator service."""

    def __init__(self, address: str | None = None, *, token: str | None = None, timeout: float = 600.0,
                 tls: ClientTLS | None = None):
        # No address: MESHRL_COORDINATOR, else the mesh `meshrl mesh` recorded (coordinator/mesh_address.py).
        self.address = find_coordinator(address).address
        address = self.address
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.enable_retries", 1), ("grpc.service_config", service_config(round_robin=False))]
        if tls is None:
            self._channel = grpc.insecure_channel(address, options=options)
        else:
            if tls.server_name:
                options.append(("grpc.ssl_target_name_override", tls.server_name))
            self._channel = grpc.secure_channel(address, tls.credentials(), options=options)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._timeout = timeout

    def _call(self, method: str, request, timeout: float | None = None):
        return getattr(self._stub, method)(request, metadata=self._metadata, timeout=timeout or self._timeout)

    def start_run(self, config: "RunConfig | dict | str | Path", run_id: str = "") -> str:
        return self._call("StartRun", coordinator_pb2.StartRunRequest(config=config_text(config),
                                                                      run_id=run_id)).run_id

    def get_run(self, run_id: str) -> RunStatus:
        return _status(self._call("GetRun", coordinator_pb2.RunRequest(run_id=run_id)))

    def list_runs(self) -> list[RunStatus]:
        return [_status(r) for r in self._call("ListRuns", coordinator_pb2.ListRunsRequest()).runs]

    def stream_metrics(self, run_id: str, from_step: int = 0) -> Iterator[dict]:
        """Per-step metric dicts (with "step"), following the run until it ends."""
        stream = self._stub.StreamMetrics(coordinator_pb2.StreamMetricsRequest(run_id=run_id, from_step=from_step),
                                          metadata=self._metadata)
        for m in stream:
            yield {"step": m.step, "timestamp": m.timestamp, **dict(m.metrics)}

    def pause_run(self, run_id: str) -> RunStatus:
        return _status(self._call("PauseRun", coordinator_pb2.RunRequest(run_id=run_id)))

    def resume_run(self, run_id: str) -> RunStatus:
        return _status(self._call("ResumeRun", coordinator_pb2.RunRequest(run_id=run_id)))

    def stop_run(self, run_id: str) -> RunStatus:
        return _status(self._call("StopRun", coordinator_pb2.RunRequest(run_id=run_id)))

    def save_checkpoint(self, run_id: str) -> RunStatus:
        return _status(self._call("SaveCheckpoint", coordinator_pb2.RunRequest(run_id=run_id)))

    def list_services(self, run_id: str = "") -> list[Replica]:
        resp = self._call("ListServices", coordinator_pb2.ListServicesRequest(run_id=run_id))
        return [Replica(r.pool, r.address, r.healthy, r.weight_version, r.load) for r in resp.replicas]

    def wait(self, run_id: str) -> RunStatus:
        for _ in self.stream_metrics(run_id):
            pass
        return self.get_run(run_id)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def metrics_file(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
