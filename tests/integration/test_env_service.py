"""The env service over real gRPC: tool calls and episodes from a plain client (generated stubs, no meshrl
client code), health and reflection, and `meshrl serve env` as its own process."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from meshrl.v1 import common_pb2, env_pb2, env_pb2_grpc
from services.common.config import load_config
from services.env.config import EnvSettings
from services.env.servicer import start


async def with_service(env: dict, fn):
    mesh, port, engine = await start(load_config(EnvSettings, data={"env": env}), "127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            return await fn(env_pb2_grpc.EnvStub(channel), channel)
    finally:
        await mesh.stop(0)
        await engine.close()


def test_tool_calls_through_the_service_answer_in_order_with_error_observations():
    calls = [env_pb2.ToolCall(id="1", name="calculator", arguments_json='{"expression": "987 * 654"}'),
             env_pb2.ToolCall(id="2", name="python", arguments_json=json.dumps({"code": "while True: pass"})),
             env_pb2.ToolCall(id="3", name="python", arguments_json=json.dumps({"code": "sum(range(10))"})),
             env_pb2.ToolCall(id="4", name="search", arguments_json="{}")]

    async def call(stub, _):
        return await stub.CallTools(env_pb2.CallToolsRequest(calls=calls, episode_id="ep"), timeout=60)

    results = asyncio.run(with_service({"python": {"timeout_s": 3, "cpu_s": 1}}, call)).results
    assert [r.id for r in results] == ["1", "2", "3", "4"]
    assert (results[0].content, results[0].error) == ("645498", "")
    assert "timed out" in results[1].error or "CPU time limit" in results[1].error
    assert (results[2].content, results[2].error) == ("45\n", "")
    assert results[3].content.startswith("Error: unknown tool 'search'")


def test_list_tools_and_info_describe_the_replica():
    async def call(stub, _):
        tools = await stub.ListTools(env_pb2.ListToolsRequest())
        info = await stub.GetInfo(common_pb2.GetInfoRequest())
        return tools, info

    tools, info = asyncio.run(with_service({}, call))
    names = [json.loads(t)["function"]["name"] for t in tools.tools_json]
    assert names == ["calculator", "python"]
    assert info.role == "env"
    assert "timeout 10s" in info.details["python_sandbox"]
    assert json.loads(info.details["settings"])["env"]["builtin_tools"] == ["calculator", "python"]


def test_an_episode_lives_on_its_replica_until_done_and_bad_input_names_the_field():
    async def call(stub, _):
        first = await stub.Reset(env_pb2.ResetRequest(episode_id="e1", environment="guess_number",
                                                      kwargs_json='{"low": 1, "high": 2, "seed": 3}'))
        steps = []
        for guess in (1, 2):
            steps.append(await stub.Step(env_pb2.StepRequest(episode_id="e1", action=f"I guess {guess}")))
            if steps[-1].done:
                break
        errors = []
        for request in (stub.Step(env_pb2.StepRequest(episode_id="e1", action="1")),
                        stub.Reset(env_pb2.ResetRequest(episode_id="e2", environment="chess")),
                        stub.Reset(env_pb2.ResetRequest(episode_id="e2", environment="guess_number",
                                                        kwargs_json="[1]")),
                        stub.CallTools(env_pb2.CallToolsRequest())):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await request
            errors.append((err.value.code(), err.value.details()))
        return first, steps, errors

    first, steps, errors = asyncio.run(with_service({}, call))
    assert first.observation.startswith("I picked a number between 1 and 2")
    assert [s.done for s in steps] == [False] * (len(steps) - 1) + [True]
    assert [s.reward for s in steps][-1] == 1.0 and "Correct" in steps[-1].observation
    codes = [c for c, _ in errors]
    assert codes[0] == grpc.StatusCode.NOT_FOUND and "episode_id: no episode 'e1'" in errors[0][1]
    assert codes[1:] == [grpc.StatusCode.INVALID_ARGUMENT] * 3
    assert errors[1][1].startswith("environment: unknown environment 'chess'")
    assert errors[2][1] == "kwargs_json: must be a JSON object"
    assert errors[3][1] == "calls: give at least one tool call"


def test_health_and_reflection_name_the_env_service():
    async def call(_, channel):
        health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="meshrl.v1.Env"))

        async def ask():
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        names = []
        async for resp in reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(ask()):
            names = [s.name for s in resp.list_services_response.service]
        return health, names

    health, names = asyncio.run(with_service({"builtin_tools": ["calculator"]}, call))
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert "meshrl.v1.Env" in names


def test_meshrl_serve_env_announces_its_port_and_serves_until_signalled():
    proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "serve", "env", "--port", "0"],
                            env={**os.environ, "MESHRL_ENV__BUILTIN_TOOLS": '["calculator"]'},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if m := re.search(r"meshrl env listening on 127\.0\.0\.1:(\d+)", line):
                port = int(m[1])
                break
        else:
            raise AssertionError("".join(lines))

        async def call():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await env_pb2_grpc.EnvStub(channel).CallTools(env_pb2.CallToolsRequest(
                    calls=[env_pb2.ToolCall(id="x", name="calculator", arguments_json='{"expression": "2+2"}')]),
                    timeout=30)

        assert asyncio.run(call()).results[0].content == "4"
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_a_bad_env_setting_is_one_line_naming_the_key():
    out = subprocess.run([sys.executable, "-m", "services.env", "--env.python.timeout_s", "-1"],
                         env={**os.environ, "MESHRL_ENV__BUILTIN_TOOLS": '["shell"]'},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1, out.stderr
    assert "env.builtin_tools: unknown tool 'shell' (built-ins: calculator, python)" in out.stderr
    assert "env.python.timeout_s: Input should be greater than 0" in out.stderr
