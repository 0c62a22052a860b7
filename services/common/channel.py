"""Client channels: retry on UNAVAILABLE, a deadline on every call, bearer token, big messages."""

from __future__ import annotations

import json
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


class _Defaults(grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.UnaryStreamClientInterceptor,
                grpc.aio.StreamUnaryClientInterceptor, grpc.aio.StreamStreamClientInterceptor):
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

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)

    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


def create_channel(address: str, *, token: str | None = None, timeout: float | None = DEFAULT_TIMEOUT_S,
                   max_message_bytes: int = MAX_MESSAGE_BYTES, max_attempts: int = 4) -> grpc.aio.Channel:
    """An insecure grpc.aio channel to `address` ("host:port" or "dns:///name:port")."""
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.enable_retries", 1),
        ("grpc.service_config", service_config(max_attempts=max_attempts)),
        ("grpc.keepalive_time_ms", 30_000),
    ]
    return grpc.aio.insecure_channel(address, options=options, interceptors=[_Defaults(token, timeout)])
