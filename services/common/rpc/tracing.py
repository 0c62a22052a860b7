"""One OpenTelemetry trace per training step across every service (docs/observability.md).

The coordinator opens a step's root span; its phases and every RPC they make are children. The W3C
`traceparent` rides in gRPC metadata, so a service's server span (and the calls it makes in turn, the trainer's
weight push) hang under the caller's span. Where spans go:
- every process exports its own spans by OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set (a collector: Jaeger,
  Tempo, ...);
- a caller that keeps a trace file (the coordinator's `runs/<id>/traces.jsonl`) asks for the spans back: the
  server returns the spans it made for that call in its trailing metadata (zlib'd JSON, capped), so a service
  in another process, container or machine needs no shared disk and no collector.
Untraced calls (no context in the metadata, no span current) cost one dict look-up.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import os
import threading
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import grpc

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger("meshrl.tracing")

TRACEPARENT = "traceparent"
# A caller that keeps the trace asks for the server's spans with this header; they come back under SPANS_KEY.
RETURN_KEY = "meshrl-return-spans"
SPANS_KEY = "meshrl-spans-bin"
# Trailing metadata stays well under gRPC's 8 KiB default limit on received metadata: past this the deepest spans
# are left out (counted on the server span), never the call failed.
MAX_RETURNED_BYTES = 6000
# Methods never traced: probes, not work.
UNTRACED_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

_propagator = TraceContextTextMapPropagator()
# Spans that end while serving a call whose caller asked for them (the server span's own list).
_collecting: contextvars.ContextVar[list | None] = contextvars.ContextVar("meshrl_collect_spans", default=None)
_provider: TracerProvider | None = None
_lock = threading.Lock()


def span_record(span: ReadableSpan) -> dict:
    """A finished span as one JSON-able dict (the lines of traces.jsonl)."""
    ctx, parent = span.context, span.parent
    attrs = dict(span.attributes or {})      # only str/int/float/bool are set here
    return {"trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}",
            "parent_id": f"{parent.span_id:016x}" if parent else None, "name": span.name,
            "kind": span.kind.name.lower(), "start_ns": span.start_time, "end_ns": span.end_time,
            "status": span.status.status_code.name.lower(), "attributes": attrs}


class _TraceFiles:
    """trace id -> the JSONL file its spans go to (one per run). Spans are kept in memory while the step runs and
    written when it ends, once each: a service in the coordinator's own process is seen both ending its span here
    and returning it in metadata."""

    def __init__(self):
        self.paths: dict[int, Path] = {}
        self.pending: dict[int, dict[str, dict]] = {}

    def open(self, trace_id: int, path: Path) -> None:
        with _lock:
            self.paths[trace_id] = path
            self.pending[trace_id] = {}

    def close(self, trace_id: int) -> None:
        """Writes the trace's spans (the step's root span has ended) and forgets it."""
        with _lock:
            path = self.paths.pop(trace_id, None)
            records = self.pending.pop(trace_id, {})
        if path is not None and records:
            with path.open("a") as f:
                f.writelines(json.dumps(r, separators=(",", ":")) + "\n" for r in records.values())

    def write(self, trace_id: int, records: list[dict]) -> bool:
        with _lock:
            pending = self.pending.get(trace_id)
            if pending is None:
                return False
            for r in records:
                pending.setdefault(r["span_id"], r)
        return True


_files = _TraceFiles()


class _Router(SpanProcessor):
    """Sends each finished span to the call that collects it (a server returning its spans) and to its run's
    trace file."""

    def on_end(self, span: ReadableSpan) -> None:
        collected = _collecting.get()
        record = None
        if collected is not None:
            record = span_record(span)
            collected.append(record)
        if span.context.trace_id in _files.paths:
            _files.write(span.context.trace_id, [record or span_record(span)])


def provider() -> TracerProvider:
    """This process's tracer provider (made once): our router, plus OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set."""
    global _provider
    if _provider is None:
        with _lock:
            if _provider is None:
                name = os.environ.get("OTEL_SERVICE_NAME", "meshrl")
                p = TracerProvider(resource=Resource.create({"service.name": name}))
                p.add_span_processor(_Router())
                if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get(
                        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
                    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
                    from opentelemetry.sdk.trace.export import BatchSpanProcessor

                    p.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
                    log.info("exporting traces by OTLP to %s", os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                             or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
                _provider = p
    return _provider


_tracer: trace.Tracer | None = None


def tracer() -> trace.Tracer:
    global _tracer
    if _tracer is None:
        _tracer = provider().get_tracer("meshrl")
    return _tracer


def active() -> bool:
    """A span is current (this code runs inside a traced step or a traced call)."""
    return trace.get_current_span().get_span_context().is_valid


# ---- the coordinator's side: a step's root span and its phases ------------------------------------------------

@contextmanager
def step_span(name: str, path: Path | None, **attributes) -> Iterator[trace.Span]:
    """The root span of one step; its spans (and those the services return) go to `path` (JSONL) when given."""
    span = tracer().start_span(name, context=otel_context.Context(),
                               attributes={"meshrl.role": "coordinator", **attributes})
    trace_id = span.get_span_context().trace_id
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        _files.open(trace_id, path)
    try:
        with trace.use_span(span, end_on_exit=True, record_exception=True):
            yield span
    finally:
        _files.close(trace_id)


@contextmanager
def phase_span(name: str) -> Iterator[None]:
    """A child span of the current step (nothing when no step is traced)."""
    if not active():
        yield
        return
    with tracer().start_as_current_span(name, attributes={"meshrl.role": "coordinator"}):
        yield


# ---- client side: carry the context, time the call, take the returned spans -----------------------------------

def client_span(method: str):
    """(span, metadata entries to add) for an outgoing call, or (None, ()) when no step is traced."""
    if not active():
        return None, ()
    if isinstance(method, bytes):              # grpc.aio hands client interceptors the method as bytes
        method = method.decode()
    if method.startswith(UNTRACED_PREFIXES):
        return None, ()
    service, _, rpc = method.lstrip("/").rpartition("/")
    span = tracer().start_span(f"{service.rsplit('.', 1)[-1]}/{rpc}", kind=SpanKind.CLIENT,
                               attributes={"rpc.service": service, "rpc.method": rpc})
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=trace.set_span_in_context(span))
    extra = [(k, v) for k, v in carrier.items()]
    if _collecting.get() is not None or _files.paths:
        extra.append((RETURN_KEY, "1"))
    return span, extra


def finish_client_span(span, code, trailing) -> None:
    """Ends a client span with the call's status and files the spans the server returned."""
    if code is not None and code.name != "OK":
        span.set_status(Status(StatusCode.ERROR, code.name))
    span.set_attribute("rpc.grpc.status_code", code.value[0] if code is not None else -1)
    returned = _decode(trailing)
    span.end()
    if returned:
        absorb(returned, span.get_span_context().trace_id)


def absorb(records: list[dict], trace_id: int) -> None:
    """Spans a server returned: passed up with ours when we are serving a call that returns spans, else written
    to the step's trace file."""
    collected = _collecting.get()
    if collected is not None:
        collected.extend(records)
    _files.write(trace_id, records)


def _decode(trailing) -> list[dict]:
    for key, value in trailing or ():
        if key == SPANS_KEY:
            try:
                return json.loads(zlib.decompress(value))
            except (zlib.error, ValueError):
                log.warning("ignored malformed %s trailing metadata", SPANS_KEY)
    return []


# ---- server side: the call's span under the caller's, and its spans returned -----------------------------------

class ServerSpan:
    """The span of one served call; `None` from `start` when the caller sent no trace context."""

    def __init__(self, span, token, collect_token, collected: list | None):
        self.span, self._token, self._collect_token, self.collected = span, token, collect_token, collected

    @classmethod
    def start(cls, method: str, metadata, role: str) -> "ServerSpan | None":
        if method.startswith(UNTRACED_PREFIXES):
            return None
        carrier, wants = {}, False
        for key, value in metadata or ():
            if key == TRACEPARENT or key == "tracestate":
                carrier[key] = value if isinstance(value, str) else value.decode()
            elif key == RETURN_KEY:
                wants = True
        if TRACEPARENT not in carrier:
            return None
        parent = _propagator.extract(carrier)
        service, _, rpc = method.lstrip("/").rpartition("/")
        span = tracer().start_span(f"{role} {rpc}", context=parent, kind=SpanKind.SERVER,
                                   attributes={"rpc.service": service, "rpc.method": rpc, "meshrl.role": role})
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        collected: list | None = [] if wants else None
        return cls(span, token, _collecting.set(collected), collected)

    def end(self, code_name: str) -> bytes | None:
        """Ends the span; returns the spans to send back (encoded) when the caller asked for them."""
        if code_name != "OK":
            self.span.set_status(Status(StatusCode.ERROR, code_name))
        self.span.set_attribute("rpc.grpc.status_code_name", code_name)
        self.span.end()
        _collecting.reset(self._collect_token)
        otel_context.detach(self._token)
        if self.collected is None:
            return None
        return encode_returned(self.collected)


def encode_returned(records: list[dict]) -> bytes:
    """zlib'd JSON of the spans, the server span (last to end) always kept; deeper ones dropped past the cap."""
    kept = list(records)
    while True:
        data = zlib.compress(json.dumps(kept, separators=(",", ":")).encode(), 1)
        if len(data) <= MAX_RETURNED_BYTES or len(kept) <= 1:
            return data
        kept = kept[len(kept) // 4 or 1:]  # the earliest-ended spans are the deepest
        kept[-1] = {**kept[-1], "attributes": {**kept[-1]["attributes"],
                                               "meshrl.spans_dropped": len(records) - len(kept)}}


# ---- what create_channel's client interceptors call (services/common/rpc/channel.py) ----------------------------

def _with_metadata(details, extra):
    metadata = grpc.aio.Metadata(*(tuple(details.metadata) if details.metadata else ()), *extra)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


async def traced_call(continuation, details, request):
    """A call with one answer. Traced, it is awaited here, so its span ends with its status and takes the returned
    spans before the caller goes on; the call is handed back done (awaiting it again gives the answer or the
    error)."""
    span, extra = client_span(details.method)
    if span is None:
        return await continuation(details, request)
    call = await continuation(_with_metadata(details, extra), request)
    try:
        await call
    except grpc.aio.AioRpcError:
        pass
    except asyncio.CancelledError:
        span.set_status(Status(StatusCode.ERROR, "CANCELLED"))
        span.end()
        raise
    finish_client_span(span, await call.code(), await call.trailing_metadata())
    return call


async def traced_stream(continuation, details, request):
    """A call that streams its answer: traced, its span ends when the stream does."""
    span, extra = client_span(details.method)
    if span is None:
        return await continuation(details, request)
    call = await continuation(_with_metadata(details, extra), request)
    call.add_done_callback(lambda _: span.end())
    return call
