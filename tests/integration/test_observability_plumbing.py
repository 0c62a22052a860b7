"""The metrics and trace plumbing of every server (services/common/rpc/metrics.py, tracing.py) on a real reward server on
port 0: calls counted by status code on the /metrics endpoint, a traced call's server span returned to the caller
and filed under its client span, untraced calls leaving no trace."""

import asyncio
import json
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshrl.v1 import reward_pb2, reward_pb2_grpc
from services.common.rpc import metrics, tracing
from services.common.rpc.channel import create_channel
from services.common.config import load_config
from services.reward.config import RewardSettings
from services.reward.servicer import start


def scrape(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict, name: str, **labels) -> float:
    """The sum over the samples of `name` whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())


def score_calls(samples: dict, code: str) -> float:
    return value(samples, "meshrl_rpc_requests_total", code=code, method="Score", grpc_service="meshrl.v1.Reward")


async def with_reward(fn):
    settings = load_config(RewardSettings, data={"server": {"metrics_port": 0}})
    mesh, port, engine = await start(settings, "127.0.0.1:0")
    try:
        async with create_channel(f"127.0.0.1:{port}", timeout=30) as channel:
            return await fn(reward_pb2_grpc.RewardStub(channel))
    finally:
        await mesh.stop(0)
        await engine.close()


def request(n: int = 1):
    return reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(id=f"s{i}", prompt="1+1=", response="2",
                                                               ground_truth="2") for i in range(n)])


def test_every_call_is_counted_by_status_code_on_the_metrics_endpoint():
    async def calls(stub):
        port = metrics.serve_metrics(0, "127.0.0.1", "reward")     # the process's endpoint the server started
        before = await asyncio.to_thread(scrape, port)
        await stub.Score(request())
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.Score(reward_pb2.ScoreRequest())             # no items: INVALID_ARGUMENT
        return before, await asyncio.to_thread(scrape, port)

    before, after = asyncio.run(with_reward(calls))
    assert score_calls(after, "OK") == score_calls(before, "OK") + 1
    assert score_calls(after, "INVALID_ARGUMENT") == score_calls(before, "INVALID_ARGUMENT") + 1
    score = {"method": "Score", "grpc_service": "meshrl.v1.Reward"}
    assert value(after, "meshrl_rpc_duration_seconds_count", **score) == \
        value(before, "meshrl_rpc_duration_seconds_count", **score) + 2
    assert ("meshrl_rpc_in_flight_requests", tuple(sorted(score.items()))) in after
    assert value(after, "meshrl_rpc_in_flight_requests", **score) == 0


def test_a_traced_call_files_the_servers_span_under_its_client_span_and_an_untraced_call_files_nothing(tmp_path):
    path = tmp_path / "traces.jsonl"

    async def calls(stub):
        await stub.Score(request())                                 # before any step: untraced
        with tracing.step_span("step 1", path, **{"meshrl.step": 1}):
            with tracing.phase_span("reward"):
                await stub.Score(request())
        await stub.Score(request())                                 # after the step: untraced again

    asyncio.run(with_reward(calls))
    spans = {s["name"]: s for s in map(json.loads, path.read_text().splitlines())}
    assert sorted(spans) == ["Reward/Score", "reward", "reward Score", "step 1"]
    assert len({s["trace_id"] for s in spans.values()}) == 1
    assert spans["step 1"]["parent_id"] is None
    assert spans["reward"]["parent_id"] == spans["step 1"]["span_id"]
    assert spans["Reward/Score"]["parent_id"] == spans["reward"]["span_id"]
    assert spans["reward Score"]["parent_id"] == spans["Reward/Score"]["span_id"]
    assert spans["reward Score"]["kind"] == "server" and spans["reward Score"]["attributes"]["meshrl.role"] == "reward"
    assert spans["Reward/Score"]["attributes"]["rpc.grpc.status_code"] == 0


def test_returned_spans_stay_under_the_metadata_cap_keeping_the_server_span():
    records = [{"trace_id": "ab" * 16, "span_id": f"{i:016x}", "parent_id": "cd" * 8, "name": f"span {i} " + "x" * 40,
                "kind": "client", "start_ns": i, "end_ns": i + 1, "status": "unset",
                "attributes": {"n": i, "text": str(i * 7919) * 5}} for i in range(2000)]
    data = tracing.encode_returned(records)
    assert len(data) <= tracing.MAX_RETURNED_BYTES
    kept = json.loads(__import__("zlib").decompress(data))
    assert kept[-1]["span_id"] == records[-1]["span_id"]           # the server span ends last and is kept
    assert kept[-1]["attributes"]["meshrl.spans_dropped"] == 2000 - len(kept)


def test_a_metrics_port_out_of_range_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"server\.metrics_port"):
        load_config(RewardSettings, data={"server": {"metrics_port": 70000}})


def test_a_metrics_port_in_use_is_refused_naming_the_key():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        saved, metrics._server = metrics._server, None      # as in a fresh process
        try:
            with pytest.raises(ValueError, match=rf"server\.metrics_port: cannot serve metrics on 127\.0\.0\.1:{port} "
                                                 r"\(.*\); 0 picks a free port"):
                metrics.serve_metrics(port, "127.0.0.1", "reward")
        finally:
            metrics._server = saved


TRACED_CHILD = """
import asyncio
from pathlib import Path
from services.common.rpc import tracing
from tests.integration.test_observability_plumbing import request, with_reward

async def calls(stub):
    with tracing.step_span("step 1", None, **{"meshrl.step": 1}):
        await stub.Score(request())

asyncio.run(with_reward(calls))
assert tracing.provider().force_flush(10_000)
"""


def test_spans_are_exported_by_otlp_when_an_endpoint_is_set():
    """A real OTLP/gRPC collector on port 0 receives the step's span and the server's (one trace)."""
    import os
    import subprocess
    import sys
    from concurrent import futures
    from pathlib import Path

    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received = []

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, req, context):
            received.extend((s.name, s.trace_id.hex()) for rs in req.resource_spans for ss in rs.scope_spans
                            for s in ss.spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        repo = Path(__file__).resolve().parents[2]
        env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_EXPORTER_OTLP_INSECURE": "true",
               "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, "-c", TRACED_CHILD], cwd=repo, env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
    finally:
        server.stop(0)
    names = {name for name, _ in received}
    assert {"step 1", "Reward/Score", "reward Score"} <= names
    assert len({trace_id for _, trace_id in received}) == 1
