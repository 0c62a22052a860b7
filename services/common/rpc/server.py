"""gRPC server plumbing shared by every service: factory, health, reflection, errors, auth, TLS, shutdown."""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import socket
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.rpc.channel import ClientTLS, read_pem, set_default_tls
from services.common.config import ServerConfig
from services.common.errors import MeshError, passes_through
from services.common.rpc.metrics import ObservingInterceptor, serve_metrics

log = logging.getLogger("meshrl.server")

# Health and reflection stay reachable without a token so orchestrators can probe.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The one place where Python exceptions become gRPC status codes."""
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, MeshError):
        return getattr(grpc.StatusCode, exc.status), str(exc)
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "timed out"
    if _out_of_memory(exc):
        # The request asked for more memory than the service has; the next one may well fit.
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"out of memory serving this request ({type(exc).__name__})"
    # A library's BaseException (torch's CheckpointException) may carry tracebacks: its first line is the message.
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {text}"


def _out_of_memory(exc: BaseException) -> bool:
    """MemoryError, torch's OutOfMemoryError (CUDA) and the allocator's RuntimeErrors (CPU), without importing torch."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in ("bad_alloc", "can't allocate memory",
                                                                        "CUDA out of memory"))


class ServiceInterceptor(grpc.aio.ServerInterceptor):
    """Checks the bearer token and maps exceptions raised by servicers to status codes."""

    def __init__(self, auth_token: str | None = None):
        self._expected = f"Bearer {auth_token}".encode() if auth_token else None

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        if self._expected is None or details.method.startswith(OPEN_METHOD_PREFIXES):
            return True
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                got = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(got, self._expected)
        return False

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        return _wrap(handler, None if self._authorized(details) else _deny)


async def _deny(context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")


async def _abort_for(exc: BaseException, context, method: str):
    code, message = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("%s failed:\n%s", method, "".join(traceback.format_exception(exc)))
    await context.abort(code, message)


class MalformedRequest(ValueError):
    """Request bytes that do not parse as the method's message (INVALID_ARGUMENT, not grpc's UNKNOWN)."""


def _parser(deserializer):
    """The handler's deserializer, run inside the handler so a parse error gets a status we choose."""
    if deserializer is None:
        return lambda raw: raw
    owner = getattr(deserializer, "__self__", None)
    name = getattr(getattr(owner, "DESCRIPTOR", None), "full_name", "request")

    def parse(raw: bytes):
        try:
            return deserializer(raw)
        except Exception as e:  # noqa: BLE001 - protobuf raises DecodeError, and other errors on odd input
            raise MalformedRequest(f"request: not a valid {name} message ({type(e).__name__}: {e})") from None

    return parse


# How long a failed client-streaming handler goes on reading what its client still sends (see _drain).
DRAIN_S = 30.0


async def _drain(raw_iterator, limit_s: float = DRAIN_S) -> None:
    """Reads and drops what the client still streams after its handler failed, so the client gets the handler's
    status. Ending the call while the client is mid-send makes grpc.aio's client fail that send and report
    INTERNAL ("Failed execute_batch") in place of the status the server sent; a stream still running after
    limit_s seconds gets its status anyway."""
    async def read():
        async for _ in raw_iterator:
            pass
    try:
        await asyncio.wait_for(read(), limit_s)
    except Exception:  # noqa: BLE001 - the handler's own error is the one to report
        pass


async def _parsed(raw_iterator, parse, context):
    # grpc.aio ends the request iterator the same way when the client half-closed and when it died, so a
    # client stream that must be whole says so itself (UpdateWeights: the commit message); no waiting here.
    async for raw in raw_iterator:
        yield parse(raw)
    if context.cancelled():
        raise asyncio.CancelledError


def _wrap(handler: grpc.RpcMethodHandler, deny) -> grpc.RpcMethodHandler:
    """Re-builds a method handler whose behaviour denies (auth) or maps errors, malformed requests included."""
    parse = _parser(handler.request_deserializer)
    kwargs = dict(request_deserializer=None, response_serializer=handler.response_serializer)
    if handler.unary_unary or handler.stream_unary:
        return _wrap_one_response(handler, deny, parse, kwargs)
    return _wrap_streamed_response(handler, deny, parse, kwargs)


def _wrap_one_response(handler: grpc.RpcMethodHandler, deny, parse, kwargs: dict) -> grpc.RpcMethodHandler:
    """_wrap for methods that answer with one message: the wrapper is a coroutine that returns it (or the denial)."""
    if handler.unary_unary:
        inner = handler.unary_unary

        async def unary_unary(raw, context):
            if deny:
                return await deny(context)
            try:
                return await inner(parse(raw), context)
            except (grpc.aio.AbortError, asyncio.CancelledError):
                raise
            except BaseException as e:  # noqa: BLE001 - mapped to a status, never swallowed
                if passes_through(e):
                    raise
                await _abort_for(e, context, inner.__qualname__)

        return grpc.unary_unary_rpc_method_handler(unary_unary, **kwargs)
    inner_su = handler.stream_unary

    async def stream_unary(request_iterator, context):
        if deny:
            return await deny(context)
        try:
            return await inner_su(_parsed(request_iterator, parse, context), context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except BaseException as e:  # noqa: BLE001
            if passes_through(e):
                raise
            await _drain(request_iterator)
            await _abort_for(e, context, inner_su.__qualname__)

    return grpc.stream_unary_rpc_method_handler(stream_unary, **kwargs)


def _wrap_streamed_response(handler: grpc.RpcMethodHandler, deny, parse, kwargs: dict) -> grpc.RpcMethodHandler:
    """_wrap for methods that stream their answer: the wrapper is an async generator, so a denial is awaited, not
    returned."""
    if handler.unary_stream:
        inner_us = handler.unary_stream

        async def unary_stream(raw, context):
            if deny:
                await deny(context)
                return
            try:
                async for item in inner_us(parse(raw), context):
                    yield item
            except (grpc.aio.AbortError, asyncio.CancelledError):
                raise
            except BaseException as e:  # noqa: BLE001
                if passes_through(e):
                    raise
                await _abort_for(e, context, inner_us.__qualname__)

        return grpc.unary_stream_rpc_method_handler(unary_stream, **kwargs)
    inner_ss = handler.stream_stream

    async def stream_stream(request_iterator, context):
        if deny:
            await deny(context)
            return
        try:
            async for item in inner_ss(_parsed(request_iterator, parse, context), context):
                yield item
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except BaseException as e:  # noqa: BLE001
            if passes_through(e):
                raise
            await _drain(request_iterator)
            await _abort_for(e, context, inner_ss.__qualname__)

    return grpc.stream_stream_rpc_method_handler(stream_stream, **kwargs)


def server_options(config: ServerConfig) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_connection_age_ms", int(config.max_connection_age_s * 1000)),
        ("grpc.so_reuseport", 0),
    ]


@dataclass
class MeshServer:
    """A started grpc.aio server with its health servicer."""

    server: grpc.aio.Server
    health: health.aio.HealthServicer
    service_names: Sequence[str]
    port: int

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace: float = 5.0) -> None:
        """Health flips to NOT_SERVING first so balancers drain, then in-flight calls get `grace` seconds."""
        await self.set_serving(False)
        await self.server.stop(grace)


async def create_server(servicers: Iterable[tuple[Callable[[Any, grpc.aio.Server], None], Any]],
                        service_names: Sequence[str], *, address: str | None = None,
                        config: ServerConfig | None = None) -> tuple[MeshServer, int]:
    """Builds and starts a server for the given (add_XServicer_to_server, servicer) pairs.

    Returns the server and the bound port (address "host:0" picks a free one).
    """
    config = config or ServerConfig()
    address = address or f"{config.host}:{config.port}"
    token = config.auth_token.get_secret_value() if config.auth_token else None
    credentials = server_credentials(config)
    # The calls this service makes use the TLS settings of the same `server:` section.
    set_default_tls(ClientTLS.from_server_config(config))
    # Outermost first: metrics and trace spans see the status ServiceInterceptor maps an exception to.
    server = grpc.aio.server(interceptors=[ObservingInterceptor(), ServiceInterceptor(token)],
                             options=server_options(config))
    for add, servicer in servicers:
        add(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server)
    try:
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if port == 0:
        raise RuntimeError(bind_failure(address))
    serve_metrics(config.metrics_port, config.host, _role(service_names))     # a port in use fails before serving
    await server.start()
    mesh = MeshServer(server, health_servicer, service_names, port)
    await mesh.set_serving(True)
    return mesh, port


def bind_failure(address: str) -> str:
    """Why `address` cannot be bound, as one line ("could not bind 127.0.0.1:50051: [Errno 98] Address already in
    use"): gRPC's own error names no cause unless GRPC_VERBOSITY=debug."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)       # as gRPC binds
            s.bind((host, int(port)))
            s.listen()
    except (OSError, ValueError) as exc:
        return f"could not bind {address}: {exc}"
    return f"could not bind {address}"


def _role(service_names: Sequence[str]) -> str:
    """meshrl.v1.Rollout -> rollout (the word launchers and logs use)."""
    return service_names[0].rsplit(".", 1)[-1].lower() if service_names else "service"


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from server.tls_cert/tls_key (and tls_client_ca for mutual TLS); None = plaintext."""
    if not config.tls_cert:
        return None
    cert, key = read_pem(config.tls_cert, "server.tls_cert"), read_pem(config.tls_key, "server.tls_key")
    client_ca = read_pem(config.tls_client_ca, "server.tls_client_ca")
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def announce(role: str, host: str, port: int) -> None:
    """The one line launchers parse to learn where a service listens."""
    print(f"meshrl {role} listening on {host}:{port}", flush=True)


async def serve_until_signalled(mesh: MeshServer, *, grace: float,
                                on_stop: Callable[[], Awaitable[None]] | None = None) -> None:
    """Runs until SIGTERM/SIGINT, then drains: NOT_SERVING, `grace` seconds for in-flight calls."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - non-main thread
            pass
    waiter = asyncio.create_task(mesh.server.wait_for_termination())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if on_stop:
        await on_stop()
    await mesh.stop(grace)
    waiter.cancel()
    stopper.cancel()


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
