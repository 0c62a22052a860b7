"""The `openai` rollout engine, proxying to another replica's OpenAI-compatible HTTP API."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from meshrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.common.rpc.channel import create_channel
from services.rollout.config import RolloutSettings
from services.rollout.servicer import start
from services.rollout.testing import make_tiny_model, random_state_like
from services.rollout.weights_client import push_weights

pytest.importorskip("aiohttp")
pytest.importorskip("openai")

PROMPT = [4, 5, 13, 6, 15]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("rollout_upstream_model"))


@contextlib.asynccontextmanager
async def grpc_replica(settings: RolloutSettings):
    mesh, port, replica = await start(settings, "127.0.0.1:0")
    channel = create_channel(f"127.0.0.1:{port}", timeout=60)
    try:
        yield rollout_pb2_grpc.RolloutStub(channel), replica
    finally:
        await channel.close()
        await mesh.stop(0)
        await replica.close()


@contextlib.asynccontextmanager
async def upstream_and_proxy(model_dir: str, proxy_model_path: str | None = None, **proxy_rollout):
    upstream = RolloutSettings(model={"path": model_dir}, rollout={"http_port": 0})
    async with grpc_replica(upstream) as (up_stub, up):
        proxy = RolloutSettings(model={"path": proxy_model_path or model_dir},
                                rollout=dict(engine="openai", server_url=f"http://127.0.0.1:{up.http_port}/v1",
                                             **proxy_rollout))
        async with grpc_replica(proxy) as (stub, _):
            yield up_stub, stub


def request(**sampling) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(
        prompts=[rollout_pb2.Prompt(id="a", prompt_ids=PROMPT), rollout_pb2.Prompt(id="b", text="9+9=")],
        sampling=rollout_pb2.SamplingParams(**sampling))


def test_proxied_generation_equals_the_upstream_replicas_own(model_dir, tmp_path):
    async def main():
        # The proxy gets no tokenizer: ids must come from the upstream's token-id extensions.
        async with upstream_and_proxy(model_dir, proxy_model_path=str(tmp_path)) as (up_stub, stub):
            req = request(n=3, temperature=1.0, top_p=0.9, max_tokens=8, seed=21)
            return await up_stub.Generate(req), await stub.Generate(req)

    direct, proxied = asyncio.run(main())
    assert [r.prompt_id for r in proxied.responses] == ["a", "b"]
    assert list(proxied.responses[1].prompt_ids) == list(direct.responses[1].prompt_ids)
    for d, p in zip(direct.responses, proxied.responses):
        assert [list(s.response_ids) for s in p.samples] == [list(s.response_ids) for s in d.samples]
        assert [s.text for s in p.samples] == [s.text for s in d.samples]
        assert [s.finish_reason for s in p.samples] == [s.finish_reason for s in d.samples]
        for ps, ds in zip(p.samples, d.samples):
            # The proxy sends one request per prompt, so the upstream pads differently: float noise only.
            assert max(abs(a - b) for a, b in zip(ps.logprobs, ds.logprobs)) < 1e-4


def test_the_proxy_reports_the_upstreams_weight_version(model_dir):
    async def main():
        async with upstream_and_proxy(model_dir, upstream_model=model_dir) as (up_stub, stub):
            from transformers import AutoModelForCausalLM
            shape_model = AutoModelForCausalLM.from_pretrained(model_dir)
            await push_weights(up_stub, random_state_like(shape_model, seed=1), version=6)
            return await stub.Generate(request(n=1, temperature=0.0, max_tokens=3))

    resp = asyncio.run(main())
    assert {s.weight_version for r in resp.responses for s in r.samples} == {6}


def test_update_weights_on_the_proxy_is_failed_precondition(model_dir):
    async def main():
        async with upstream_and_proxy(model_dir) as (_, stub):
            from transformers import AutoModelForCausalLM
            shape_model = AutoModelForCausalLM.from_pretrained(model_dir)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await push_weights(stub, random_state_like(shape_model, seed=2), version=1)
            with pytest.raises(grpc.aio.AioRpcError) as lp_err:
                await stub.ComputeLogProbs(common_pb2.LogProbsRequest(sequences=[
                    common_pb2.TokenSequence(id="s", prompt_ids=PROMPT, response_ids=[4])]))
            info = await stub.GetInfo(common_pb2.GetInfoRequest())
            return err.value, lp_err.value, info

    err, lp_err, info = asyncio.run(main())
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "cannot take weights" in err.details()
    assert "rollout.weights_dir is not set" in err.details()
    assert lp_err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert info.details["engine"] == "openai" and info.details["server_url"].startswith("http://127.0.0.1:")
    assert info.details["weight_updates"] == "none"
    assert info.weight_version == 0


def test_upstream_rejections_become_invalid_argument(model_dir):
    async def main():
        async with upstream_and_proxy(model_dir) as (_, stub):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(rollout_pb2.GenerateRequest(
                    prompts=[rollout_pb2.Prompt(id="x", prompt_ids=[4, 777])],
                    sampling=rollout_pb2.SamplingParams(max_tokens=2)))
            with pytest.raises(grpc.aio.AioRpcError) as local:
                await stub.Generate(request(temperature=-1.0))
            return err.value, local.value

    err, local = asyncio.run(main())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "token id 777" in err.details()
    assert local.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.temperature" in local.details()


def test_an_unreachable_upstream_is_unavailable(model_dir):
    async def main():
        settings = RolloutSettings(model={"path": model_dir}, rollout=dict(
            engine="openai", server_url="http://127.0.0.1:9/v1", upstream_model="m", request_timeout_s=5,
            request_retries=0))
        async with grpc_replica(settings) as (stub, _):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(request(max_tokens=2))
            return err.value

    err = asyncio.run(main())
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "cannot reach" in err.details()


def test_the_openai_engine_needs_a_server_url(model_dir):
    from services.rollout.engines import build_engine
    with pytest.raises(ValueError, match="rollout.server_url"):
        build_engine(RolloutSettings(model={"path": model_dir}, rollout={"engine": "openai"}))


def test_chat_through_a_proxy_replica_sends_the_templated_prompt_with_one_bos(model_dir):
    openai = pytest.importorskip("openai")

    async def main():
        upstream = RolloutSettings(model={"path": model_dir}, rollout={"http_port": 0})
        async with grpc_replica(upstream) as (_, up):
            proxy = RolloutSettings(model={"path": model_dir}, rollout=dict(
                engine="openai", server_url=f"http://127.0.0.1:{up.http_port}/v1", http_port=0))
            async with grpc_replica(proxy) as (_, px):
                client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{px.http_port}/v1", api_key="none")
                resp = await client.chat.completions.create(
                    model=model_dir, messages=[{"role": "user", "content": "1+1="}], max_tokens=3, temperature=0,
                    extra_body={"return_token_ids": True})
                await client.close()
                return resp

    resp = asyncio.run(main())
    ids = resp.choices[0].model_extra["prompt_token_ids"]
    assert ids[0] == 1 and ids.count(1) == 1          # <s>u:1+1=\na: with a single bos
    assert len(resp.choices[0].model_extra["token_ids"]) <= 3
