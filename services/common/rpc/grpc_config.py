"""What a gRPC client of the mesh configures, with nothing heavier than grpcio: message limits, the retry and
load-balancing service config, TLS credentials. Scripts' clients (coordinator/client.py) import this, not
services/common/rpc/channel.py, whose channels also trace calls (OpenTelemetry)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

DEFAULT_TIMEOUT_S = 600.0
MAX_MESSAGE_BYTES = 256 * 1024 * 1024


def service_config(*, max_attempts: int = 4, round_robin: bool = True) -> str:
    """gRPC service config: transparent retries of UNAVAILABLE with backoff; round_robin must be asked for."""
    cfg: dict[str, Any] = {}
    if max_attempts >= 2:  # gRPC rejects a retry policy with fewer than 2 attempts
        cfg["methodConfig"] = [{
            "name": [{}],
            "retryPolicy": {
                "maxAttempts": max_attempts,
                "initialBackoff": "0.1s",
                "maxBackoff": "2s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }]
    if round_robin:
        cfg["loadBalancingConfig"] = [{"round_robin": {}}]
    return json.dumps(cfg)


def read_pem(path: str | None, key: str) -> bytes | None:
    """The bytes of a PEM file named by config key `key`; a missing file fails naming the key."""
    if not path:
        return None
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{key}: file {path!r} does not exist")
    return p.read_bytes()


@dataclass(frozen=True)
class ClientTLS:
    """TLS of outgoing channels: the CA that signs the servers, and (mutual TLS) our own certificate."""

    root_certificates: bytes | None = None
    private_key: bytes | None = None
    certificate_chain: bytes | None = None
    # Name expected in the server's certificate when it differs from the host dialled.
    server_name: str | None = None

    @classmethod
    def from_files(cls, ca: str, cert: str | None = None, key: str | None = None,
                   server_name: str | None = None) -> "ClientTLS":
        """For scripts: `Client(address, tls=ClientTLS.from_files("ca.pem", "me.pem", "me.key"))`."""
        return cls(read_pem(ca, "ca"), read_pem(key, "key"), read_pem(cert, "cert"), server_name)

    @classmethod
    def from_server_config(cls, cfg) -> "ClientTLS | None":
        """A service calls others with the TLS of its `server:` section: tls_ca, tls_client_cert/key
        (default tls_cert/tls_key when the server itself does mutual TLS). None when tls_ca is unset."""
        if not cfg.tls_ca:
            return None
        cert = cfg.tls_client_cert or (cfg.tls_cert if cfg.tls_client_ca else None)
        key = cfg.tls_client_key or (cfg.tls_key if cfg.tls_client_ca else None)
        return cls(read_pem(cfg.tls_ca, "server.tls_ca"),
                   read_pem(key, "server.tls_client_key" if cfg.tls_client_key else "server.tls_key"),
                   read_pem(cert, "server.tls_client_cert" if cfg.tls_client_cert else "server.tls_cert"),
                   cfg.tls_server_name)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)
