"""GenerateEpisodes from a plain gRPC client (generated stubs only) on a rollout replica serving the committed arith
model, with a real env replica: the columns line up, log-probs are the model's, bad settings are INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio
import json

import grpc
import numpy as np
import pytest

from meshrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.common.config import load_config
from services.env.config import EnvSettings
from services.env.servicer import start as start_env
from services.rollout.config import RolloutSettings
from services.rollout.servicer import start as start_rollout


def rows(ragged: common_pb2.Ragged, dtype) -> list[np.ndarray]:
    lengths = np.frombuffer(ragged.lengths, "<i4")
    values = np.frombuffer(ragged.values, dtype)
    return np.split(values, np.cumsum(lengths)[:-1])


async def serve_and_call(model_path: str, fn):
    # No tools hosted: the arith model's 64 positions have no room for tool schemas in the prompt.
    env_mesh, env_port, env_engine = await start_env(load_config(EnvSettings, data={"env": {"builtin_tools": []}}),
                                                     "127.0.0.1:0")
    settings = RolloutSettings(model={"path": model_path}, rollout={"max_tokens": 8},
                               env={"servers": [f"127.0.0.1:{env_port}"]})
    mesh, port, replica = await start_rollout(settings, "127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            return await fn(rollout_pb2_grpc.RolloutStub(channel))
    finally:
        await mesh.stop(0)
        await replica.close()
        await env_mesh.stop(0)
        await env_engine.close()


def test_generate_episodes_from_a_plain_client_returns_lined_up_columns_with_the_models_logprobs(arith_model_path):
    request = rollout_pb2.GenerateEpisodesRequest(
        prompts=[rollout_pb2.EpisodePrompt(id="a", messages_json=json.dumps([{"role": "user", "content": "12+7="}])),
                 rollout_pb2.EpisodePrompt(id="b", text="3+4=", agent_name="single_turn_agent")],
        sampling=rollout_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=5),
        agent=rollout_pb2.AgentSpec(name="tool_agent", max_turns=2, max_total_tokens=12))

    async def call(stub):
        response = await stub.GenerateEpisodes(request, timeout=120)
        infos = [e for g in response.groups for e in g.episodes]
        sequences = [common_pb2.TokenSequence(prompt_ids=g.prompt_ids, response_ids=ids)
                     for g, ids in zip([g for g in response.groups for _ in g.episodes],
                                       rows(response.response_rows, "<i4"))]
        check = await stub.ComputeLogProbs(common_pb2.LogProbsRequest(sequences=sequences, temperature=1.0),
                                           timeout=120)
        return response, infos, check

    response, infos, check = asyncio.run(serve_and_call(arith_model_path, call))
    assert [g.prompt_id for g in response.groups] == ["a", "b"] and [len(g.episodes) for g in response.groups] == [2, 2]
    ids, lps = rows(response.response_rows, "<i4"), rows(response.logprob_rows, "<f4")
    masks, versions = rows(response.loss_mask_rows, "<i4"), rows(response.version_rows, "<i4")
    assert [len(r) for r in ids] == [len(r) for r in lps] == [len(r) for r in masks] == [len(r) for r in versions]
    for info, row, mask, version, lp, expected in zip(infos, ids, masks, versions, lps, check.results):
        assert info.end_reason in ("answer", "length") and info.num_turns >= 1 and 0 < len(row) <= 12
        assert set(version[mask == 1]) == {0} and set(version[mask == 0]) <= {-1}
        # the sampled tokens' log-probs are the model's given everything before them (observations included)
        np.testing.assert_allclose(lp[mask == 1], np.asarray(expected.logprobs)[mask == 1], atol=2e-4)


@pytest.mark.parametrize("agent, field", [
    (rollout_pb2.AgentSpec(name="no_such_loop"), "agent.name"),
    (rollout_pb2.AgentSpec(name="env_agent"), "rollout.agent.environment"),
    (rollout_pb2.AgentSpec(name="tool_agent", tools=["search"]), "rollout.agent.tools"),
    (rollout_pb2.AgentSpec(name="single_turn", max_turns=-1), "agent.max_turns"),
])
def test_generate_episodes_refuses_bad_agent_settings_naming_the_key(arith_model_path, agent, field):
    request = rollout_pb2.GenerateEpisodesRequest(prompts=[rollout_pb2.EpisodePrompt(id="a", text="1+1=")],
                                                  agent=agent)

    async def call(stub):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.GenerateEpisodes(request, timeout=60)
        return e.value

    error = asyncio.run(serve_and_call(arith_model_path, call))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and field in error.details()
