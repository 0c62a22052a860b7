"""Tool calls per second of one env replica over gRPC on this machine: calculator batches, sandboxed python
calls (a fresh namespaced process each), and how far past its timeout a runaway python call is answered.

    .venv/bin/python bench/env_tools.py          # writes bench/results/env_tools.json
"""
from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from bench.provenance import RESULTS, stamp  # noqa: E402
from meshrl.v1 import env_pb2, env_pb2_grpc  # noqa: E402
from services.common.config import load_config  # noqa: E402
from services.env.config import EnvSettings  # noqa: E402
from services.env.servicer import start  # noqa: E402


def _calls(name: str, args: dict, n: int) -> env_pb2.CallToolsRequest:
    return env_pb2.CallToolsRequest(calls=[env_pb2.ToolCall(id=str(i), name=name, arguments_json=json.dumps(args))
                                           for i in range(n)])


async def _rate(stub, request: env_pb2.CallToolsRequest, rounds: int) -> tuple[float, int]:
    started, errors = time.perf_counter(), 0
    for _ in range(rounds):
        errors += sum(bool(r.error) for r in (await stub.CallTools(request, timeout=300)).results)
    return rounds * len(request.calls) / (time.perf_counter() - started), errors


async def main() -> dict:
    settings = load_config(EnvSettings, data={"env": {"max_concurrency": 8, "python": {"timeout_s": 2, "cpu_s": 1}}})
    mesh, port, engine = await start(settings, "127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = env_pb2_grpc.EnvStub(channel)
            calc_rate, calc_err = await _rate(stub, _calls("calculator", {"expression": "123 * 456 - 7"}, 64), 20)
            py_rate, py_err = await _rate(stub, _calls("python", {"code": "sum(range(1000))"}, 8), 4)
            single = []
            for _ in range(8):
                t = time.perf_counter()
                await stub.CallTools(_calls("python", {"code": "print(1)"}, 1), timeout=60)
                single.append(time.perf_counter() - t)
            t = time.perf_counter()
            [runaway] = (await stub.CallTools(_calls("python", {"code": "while True: pass"}, 1), timeout=60)).results
            runaway_s = time.perf_counter() - t
    finally:
        await mesh.stop(0)
        await engine.close()
    return {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0],
                        "load_average_1min_at_start": os.getloadavg()[0]},
            "python_sandbox": engine.info()["python_sandbox"],
            "calculator": {"batch": 64, "calls_per_s": calc_rate, "errors": calc_err},
            "python": {"batch": 8, "max_concurrency": 8, "calls_per_s": py_rate, "errors": py_err,
                       "single_call_seconds_median": statistics.median(single)},
            "runaway_python": {"timeout_s": 2, "cpu_s": 1, "answered_after_s": runaway_s, "error": runaway.error}}


if __name__ == "__main__":
    result = stamp("env_tools", asyncio.run(main()), shared_machine=True)
    (RESULTS / "env_tools.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
