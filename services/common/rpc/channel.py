"""Client channels: retry on UNAVAILABLE, a deadline on every call, bearer token, big messages, TLS."""

from __future__ import annotations

import grpc

from services.common.rpc.grpc_config import (DEFAULT_TIMEOUT_S, MAX_MESSAGE_BYTES, ClientTLS, read_pem,  # noqa: F401
                                         service_config)
from services.common.rpc.tracing import traced_call, traced_stream

# What create_channel uses when it is given no TLS: the running service's own client settings, recorded by
# services.common.rpc.server.create_server from its `server:` section (None = plaintext).
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

    # Inside a traced step each call is also a client span carrying the trace context (services/common/rpc/tracing.py).
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
        # max_attempts 1: no retry machinery at all, transparent retries included (a caller that re-sends its
        # own call whole, as the weight push does, gains nothing from gRPC's retry buffer).
        ("grpc.enable_retries", int(max_attempts >= 2)),
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
