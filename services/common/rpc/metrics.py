"""Prometheus metrics of every service (docs/observability.md): one HTTP endpoint per process
(`server.metrics_port`), RPC counts by status code, latency and in-flight calls from one server interceptor, and
what each role's answers say (rollout tokens and weight version, trainer phase seconds and tokens/s), read off
the responses so no engine changes. The same interceptor opens each call's server span (services/common/tracing)."""

from __future__ import annotations

import logging
import sys
import threading
import time

import grpc
import numpy as np
from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from services.common.rpc.tracing import SPANS_KEY, ServerSpan

log = logging.getLogger("meshrl.metrics")

# Seconds: sub-millisecond info calls to multi-minute updates.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

RPC_REQUESTS = Counter("meshrl_rpc_requests", "RPCs served, by gRPC service, method and status code",
                       ["grpc_service", "method", "code"])
RPC_SECONDS = Histogram("meshrl_rpc_duration_seconds", "Seconds from a call's arrival to its status",
                        ["grpc_service", "method"], buckets=LATENCY_BUCKETS)
RPC_IN_FLIGHT = Gauge("meshrl_rpc_in_flight_requests", "Calls being served now", ["grpc_service", "method"])

ROLLOUT_TOKENS = Counter("meshrl_rollout_generated_tokens", "Response tokens generated")
ROLLOUT_SAMPLES = Counter("meshrl_rollout_samples", "Samples generated")
ROLLOUT_BATCH = Histogram("meshrl_rollout_batch_samples", "Samples per Generate call (how full the engine's batches are)",
                          buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096))
ROLLOUT_WEIGHT_VERSION = Gauge("meshrl_rollout_weight_version", "Weight version this replica serves")
ROLLOUT_WEIGHT_UPDATED = Gauge("meshrl_rollout_weight_update_timestamp_seconds",
                               "Unix time this replica's weight version last changed")
ROLLOUT_WEIGHT_BYTES = Counter("meshrl_rollout_weight_received_bytes", "Weight bytes received by UpdateWeights")

TRAINER_PHASE = Histogram("meshrl_trainer_phase_seconds", "Trainer seconds per call, by step phase", ["phase"],
                          buckets=LATENCY_BUCKETS)
TRAINER_TOKENS = Counter("meshrl_trainer_trained_tokens", "Response tokens trained on (actor updates)")
TRAINER_TOKENS_PER_S = Gauge("meshrl_trainer_tokens_per_second", "Tokens per second of the last actor update")
TRAINER_MFU = Gauge("meshrl_trainer_mfu_ratio", "Model FLOPs utilisation of the last update, when the trainer reports it")
TRAINER_WEIGHT_VERSION = Gauge("meshrl_trainer_weight_version", "Weight version the trainer last pushed")
TRAINER_PUSH_BYTES = Counter("meshrl_trainer_weight_pushed_bytes", "Weight bytes pushed to rollout replicas")

# The trainer's RPCs as the step's phases.
TRAINER_PHASES = {"TrainActor": "train", "TrainCritic": "train_critic", "TrainDPO": "train_dpo",
                  "ComputeLogProbs": "old_logprobs", "ComputeValues": "values", "PushWeights": "weight_sync",
                  "SaveCheckpoint": "checkpoint", "LoadCheckpoint": "checkpoint"}


def _rows_total(lengths: bytes) -> int:
    return int(np.frombuffer(lengths, dtype="<i4").sum()) if lengths else 0


# The rollout weight version this process last saw, and when it changed (0: never).
_weights = {"version": None, "updated": 0.0}


def _weight_version(version: int) -> None:
    if version != _weights["version"]:
        _weights.update(version=version, updated=time.time())
        ROLLOUT_WEIGHT_VERSION.set(version)
        ROLLOUT_WEIGHT_UPDATED.set(_weights["updated"])


def _generated(resp) -> None:
    samples = [s for r in resp.responses for s in r.samples]
    if resp.HasField("response_rows"):
        tokens = _rows_total(resp.response_rows.lengths)
    else:
        tokens = sum(len(s.response_ids_packed) // 4 or len(s.response_ids) for s in samples)
    ROLLOUT_TOKENS.inc(tokens)
    ROLLOUT_SAMPLES.inc(len(samples))
    ROLLOUT_BATCH.observe(len(samples))
    if samples:
        _weight_version(max(s.weight_version for s in samples))


def _weights_updated(resp) -> None:
    ROLLOUT_WEIGHT_BYTES.inc(resp.num_bytes)
    _weight_version(resp.weight_version)


def _trained(resp) -> None:
    m = resp.metrics
    if resp.repeated:
        return
    if "num_tokens" in m:
        TRAINER_TOKENS.inc(m["num_tokens"])
    if "tokens_per_s" in m:
        TRAINER_TOKENS_PER_S.set(m["tokens_per_s"])
    if "mfu" in m:
        TRAINER_MFU.set(m["mfu"])


def _pushed(resp) -> None:
    TRAINER_WEIGHT_VERSION.set(resp.weight_version)
    TRAINER_PUSH_BYTES.inc(resp.num_bytes * max(1, sum(r.ok for r in resp.results)))


# Full method name -> what its successful answer adds to the metrics.
OBSERVERS = {
    "/meshrl.v1.Rollout/Generate": _generated,
    "/meshrl.v1.Rollout/UpdateWeights": _weights_updated,
    "/meshrl.v1.Trainer/TrainActor": _trained,
    "/meshrl.v1.Trainer/TrainDPO": _trained,
    "/meshrl.v1.Trainer/PushWeights": _pushed,
}


class _GpuMemory:
    """meshrl_gpu_memory_{allocated,reserved}_bytes per CUDA device this process uses (torch already loaded and
    CUDA initialised: a scrape never initialises CUDA)."""

    def collect(self):
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return
        alloc = GaugeMetricFamily("meshrl_gpu_memory_allocated_bytes", "CUDA memory held by tensors", labels=["device"])
        reserved = GaugeMetricFamily("meshrl_gpu_memory_reserved_bytes", "CUDA memory reserved by the caching allocator",
                                     labels=["device"])
        for i in range(torch.cuda.device_count()):
            alloc.add_metric([str(i)], torch.cuda.memory_allocated(i))
            reserved.add_metric([str(i)], torch.cuda.memory_reserved(i))
        yield alloc
        yield reserved


class _WeightAge:
    """meshrl_rollout_weight_age_seconds: seconds since this replica's weight version changed (only in a process
    that served one)."""

    def collect(self):
        updated = _weights["updated"]
        if updated:
            yield GaugeMetricFamily("meshrl_rollout_weight_age_seconds",
                                    "Seconds since this replica's weight version last changed", value=time.time() - updated)


REGISTRY.register(_GpuMemory())
REGISTRY.register(_WeightAge())

_server: tuple[str, int] | None = None
_server_lock = threading.Lock()


def serve_metrics(port: int | None, host: str, role: str) -> int | None:
    """Starts this process's /metrics endpoint once (None = off; 0 = a free port), announcing where it listens;
    a second server of the same process (all services in one process) shares it."""
    global _server
    if port is None:
        return None
    with _server_lock:
        if _server is None:
            try:
                httpd, _ = start_http_server(port, addr=host)
            except OSError as e:
                raise ValueError(f"server.metrics_port: cannot serve metrics on {host}:{port} ({e.strerror or e}); "
                                 f"0 picks a free port") from None
            _server = (host, httpd.server_port)
            print(f"meshrl {role} metrics on {host}:{httpd.server_port}", flush=True)
            log.info("Prometheus metrics on http://%s:%d/metrics", host, httpd.server_port)
        elif port not in (0, _server[1]):
            log.warning("server.metrics_port=%d: this process already serves metrics on port %d", port, _server[1])
        return _server[1]


def _labels(method: str) -> tuple[str, str]:
    service, _, rpc = method.lstrip("/").rpartition("/")
    return service, rpc


class _Call:
    """One served call: counted, timed, in flight, and traced when the caller sent a trace context."""

    __slots__ = ("method", "service", "rpc", "start", "span", "observe")

    def __init__(self, method: str, context):
        self.method = method
        self.service, self.rpc = _labels(method)
        self.observe = OBSERVERS.get(method)
        self.start = time.perf_counter()
        role = self.service.rsplit(".", 1)[-1].lower()
        self.span = ServerSpan.start(method, context.invocation_metadata(), role)
        RPC_IN_FLIGHT.labels(self.service, self.rpc).inc()

    def done(self, context, code: str, response=None) -> None:
        seconds = time.perf_counter() - self.start
        RPC_IN_FLIGHT.labels(self.service, self.rpc).dec()
        RPC_REQUESTS.labels(self.service, self.rpc, code).inc()
        RPC_SECONDS.labels(self.service, self.rpc).observe(seconds)
        phase = TRAINER_PHASES.get(self.rpc) if self.service == "meshrl.v1.Trainer" else None
        if phase and code == "OK":
            TRAINER_PHASE.labels(phase).observe(seconds)
        if response is not None and self.observe is not None:
            try:
                self.observe(response)
            except Exception:  # noqa: BLE001 - a metric must never fail the call it describes
                log.exception("observing %s failed", self.method)
        if self.span is not None:
            returned = self.span.end(code)
            if returned is not None and code == "OK":
                context.set_trailing_metadata(((SPANS_KEY, returned),))


def _code(context, exc: BaseException | None) -> str:
    code = context.code()
    if code is not None and not isinstance(code, int):
        return code.name
    if isinstance(exc, BaseException) and exc.__class__.__name__ == "CancelledError":
        return "CANCELLED"
    return "UNKNOWN" if exc is not None else "OK"


# Off only to measure what observing costs (bench/observability_overhead.py): calls then go through untouched.
OBSERVE = True


class ObservingInterceptor(grpc.aio.ServerInterceptor):
    """Counts, times and traces every call of a server (outermost, so it sees the status the inner interceptor
    maps exceptions to)."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not OBSERVE:
            return handler
        return _observed(handler, details.method)


def _observed(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    kwargs = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary or handler.stream_unary:
        inner = handler.unary_unary or handler.stream_unary

        async def one_response(request, context):
            call, response, error = _Call(method, context), None, None
            try:
                response = await inner(request, context)
                return response
            except BaseException as e:
                error = e
                raise
            finally:
                call.done(context, _code(context, error), response)

        make = grpc.unary_unary_rpc_method_handler if handler.unary_unary else grpc.stream_unary_rpc_method_handler
        return make(one_response, **kwargs)
    inner_s = handler.unary_stream or handler.stream_stream

    async def streamed(request, context):
        call, error = _Call(method, context), None
        try:
            async for item in inner_s(request, context):
                yield item
        except BaseException as e:
            error = e
            raise
        finally:
            call.done(context, _code(context, error))

    make = grpc.unary_stream_rpc_method_handler if handler.unary_stream else grpc.stream_stream_rpc_method_handler
    return make(streamed, **kwargs)
