"""Client channels: retry on UNAVAILABLE, a deadline on every call, bearer token, big messages, TLS."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from services.common.tracing import traced_call, traced_stream

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


# What create_channel uses when it is given no TLS: the running service's own client settings, recorded by
# services.common.server.create_server from its `server:` section (None = plaintext).
_process_tls: ClientTLS | None = None


def set_default_tls(tls: ClientTLS | None) -> None:
    global _process_tls
    _process_tls = tls


def default_tls() -> ClientTLS | None:
    return _process_tls


class _Defaults:
    """Adds the bearer token and a default deadline to every call that has none."""

    def __init__(self, token: str | None, timeout: float | None):
        self._token = token
        self._timeout = timeout

    def _details(self, d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(tuple(d.metadata) if d.metadata else ()))
        if self._token and "authorization" not in metadata:
            metadata.add("authorization", f"Bearer {self._token}")
        timeout = d.timeout if d.timeout is not None else self._timeout
        return grpc.aio.ClientCallDetails(d.method, timeout, metadata, d.credentials, d.wait_for_ready)

    # Inside a traced step each call is also a client span carrying the trace context (services/common/tracing.py).
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await traced_call(continuation, self._details(client_call_details), request)

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await traced_stream(continuation, self._details(client_call_details), request)

    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await traced_call(continuation, self._details(client_call_details), request_iterator)

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await traced_stream(continuation, self._details(client_call_details), request_iterator)


# grpc.aio files an interceptor under the first call kind it subclasses only, so each kind gets its own.
class _UnaryUnary(_Defaults, grpc.aio.UnaryUnaryClientInterceptor):
    pass


class _UnaryStream(_Defaults, grpc.aio.UnaryStreamClientInterceptor):
    pass


class _StreamUnary(_Defaults, grpc.aio.StreamUnaryClientInterceptor):
    pass


class _StreamStream(_Defaults, grpc.aio.StreamStreamClientInterceptor):
    pass


def create_channel(address: str, *, token: str | None = None, timeout: float | None = DEFAULT_TIMEOUT_S,
                   max_message_bytes: int = MAX_MESSAGE_BYTES, max_attempts: int = 4,
                   tls: ClientTLS | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel to `address` ("host:port" or "dns:///name:port").

    TLS when `tls` is given or this process has client TLS settings (set_default_tls); plaintext otherwise.
    """
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.enable_retries", 1),
        ("grpc.service_config", service_config(max_attempts=max_attempts)),
        ("grpc.keepalive_time_ms", 30_000),
        # Each channel keeps its own connections: a new channel to a service that just restarted (a resumed
        # run's trainer) connects at once instead of inheriting another channel's failed, backing-off one.
        ("grpc.use_local_subchannel_pool", 1),
        # A restarted service is reconnected to within seconds (gRPC's default backoff grows to 120 s).
        ("grpc.max_reconnect_backoff_ms", 5_000),
    ]
    interceptors = [kind(token, timeout) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]
    tls = tls or _process_tls
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.aio.secure_channel(address, tls.credentials(), options=options, interceptors=interceptors)
