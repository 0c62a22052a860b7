"""External OpenAI-compatible servers that can train: the `openai` engine over /v1/chat/completions (ids and
log-probs exact, or re-derived once and counted), weight updates through vLLM's weight-update HTTP endpoints
(served here by a meshrl replica with rollout.http_weight_updates), and the refusal of a server without them
before step 1 of a GRPO run."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from coordinator.recipe.config import RunConfig
from coordinator.training import loop, remote
from coordinator.training.algorithms import open_context
from meshrl.v1 import common_pb2, rollout_pb2
from services.common.config import load_config
from services.local import start_local_mesh
from services.rollout.config import RolloutSettings
from services.rollout.testing import random_state_like
from services.rollout.weights_client import push_weights
from tests.integration.test_rollout_openai_engine import grpc_replica, model_dir  # noqa: F401 (fixture)

pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")


def chat_request(**sampling) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(id="a", text="1+2="),
                                                rollout_pb2.Prompt(id="b", text="9+9=")],
                                       sampling=rollout_pb2.SamplingParams(**sampling))


async def upstream_chat(port: int, model: str, text: str, **sampling):
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    try:
        return await client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                                    logprobs=True, extra_body={"return_token_ids": True},
                                                    **sampling)
    finally:
        await client.close()


@pytest.mark.parametrize("request_token_ids", [True, False])
def test_chat_through_the_proxy_keeps_the_upstreams_ids_and_logprobs(model_dir, tmp_path, request_token_ids):
    async def main():
        upstream = RolloutSettings(model={"path": model_dir}, rollout={"http_port": 0})
        async with grpc_replica(upstream) as (_, up):
            direct = await upstream_chat(up.http_port, model_dir, "1+2=", n=2, temperature=1.0, max_tokens=6,
                                         seed=5)
            # Without token ids from the server the proxy needs the tokenizer to re-derive them.
            proxy = RolloutSettings(model={"path": model_dir if not request_token_ids else str(tmp_path)},
                                    rollout=dict(engine="openai", openai_api="chat", request_token_ids=request_token_ids,
                                                 server_url=f"http://127.0.0.1:{up.http_port}/v1"))
            async with grpc_replica(proxy) as (stub, _):
                resp = await stub.Generate(chat_request(n=2, temperature=1.0, max_tokens=6, seed=5))
                info = await stub.GetInfo(common_pb2.GetInfoRequest())
        return direct, resp, info

    direct, resp, info = asyncio.run(main())
    got = resp.responses[0]
    assert list(got.prompt_ids) == direct.model_extra["prompt_token_ids"]      # the server's own template
    for sample, choice in zip(got.samples, direct.choices):
        assert list(sample.response_ids) == choice.model_extra["token_ids"]
        assert list(sample.logprobs) == pytest.approx([e.logprob for e in choice.logprobs.content], abs=1e-4)
        assert sample.text == choice.message.content
    assert info.details["openai_api"] == "chat"
    # 2 prompts: their prompt ids and 2 samples each re-derived when the server sent none
    assert info.details["rederived_token_ids"] == ("0" if request_token_ids else "6")


def test_chat_refuses_prompts_that_come_as_token_ids(model_dir):
    async def main():
        upstream = RolloutSettings(model={"path": model_dir}, rollout={"http_port": 0})
        async with grpc_replica(upstream) as (_, up):
            proxy = RolloutSettings(model={"path": model_dir}, rollout=dict(
                engine="openai", openai_api="chat", server_url=f"http://127.0.0.1:{up.http_port}/v1"))
            async with grpc_replica(proxy) as (stub, _):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Generate(rollout_pb2.GenerateRequest(
                        prompts=[rollout_pb2.Prompt(id="x", prompt_ids=[4, 5])],
                        sampling=rollout_pb2.SamplingParams(max_tokens=2)))
                return err.value

    err = asyncio.run(main())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "data.apply_chat_template" in err.details()


def test_weights_pushed_to_the_proxy_reach_the_upstream_through_its_http_endpoints(model_dir, tmp_path):
    async def main():
        from transformers import AutoModelForCausalLM
        state = random_state_like(AutoModelForCausalLM.from_pretrained(model_dir), seed=3)
        upstream = RolloutSettings(model={"path": model_dir}, rollout={"http_port": 0, "http_weight_updates": True})
        witness = RolloutSettings(model={"path": model_dir})
        async with grpc_replica(upstream) as (up_stub, up), grpc_replica(witness) as (w_stub, _):
            proxy = RolloutSettings(model={"path": model_dir}, rollout=dict(
                engine="openai", server_url=f"http://127.0.0.1:{up.http_port}/v1", weights_dir=str(tmp_path)))
            async with grpc_replica(proxy) as (stub, _):
                info = await stub.GetInfo(common_pb2.GetInfoRequest())
                await push_weights(stub, state, version=5)
                await push_weights(w_stub, state, version=5)
                seq = common_pb2.LogProbsRequest(sequences=[common_pb2.TokenSequence(
                    id="s", prompt_ids=[4, 5, 13], response_ids=[6, 15, 7])])
                got, want = await up_stub.ComputeLogProbs(seq), await w_stub.ComputeLogProbs(seq)
                gen = await stub.Generate(chat_request(n=1, temperature=0.0, max_tokens=3))
                return info, got, want, gen, await stub.GetInfo(common_pb2.GetInfoRequest())

    info, got, want, gen, after = asyncio.run(main())
    assert info.details["weight_updates"] == "vllm_http"
    assert list(got.results[0].logprobs) == pytest.approx(list(want.results[0].logprobs), abs=1e-5)
    assert after.weight_version == 5 and {s.weight_version for s in gen.responses[0].samples} == {5}
    assert [p.name for p in tmp_path.iterdir()] == ["v5"]


def _grpo(model: str, run_dir, server_url: str, weights_dir: str) -> dict:
    return {"model": {"path": model, "dtype": "float32"},
            "rollout": {"engine": "openai", "server_url": server_url, "weights_dir": weights_dir, "n": 2,
                        "max_tokens": 4},
            "actor": {"lr": 1e-4}, "algorithm": {"adv_estimator": "grpo"},
            "data": {"train_files": ["examples/arith/data/train.jsonl"], "rollout_batch_size": 2},
            "run": {"num_steps": 1, "run_dir": str(run_dir)}}


@pytest.mark.slow
@pytest.mark.parametrize("endpoints", [False, True])
def test_grpo_refuses_before_step_1_an_upstream_that_cannot_take_weights_and_trains_through_one_that_can(
        arith_model_path, tmp_path, endpoints):
    async def main():
        upstream = RolloutSettings(model={"path": arith_model_path},
                                   rollout={"http_port": 0, "http_weight_updates": endpoints})
        async with grpc_replica(upstream) as (up_stub, up):
            config = _grpo(arith_model_path, tmp_path, f"http://127.0.0.1:{up.http_port}/v1", str(tmp_path / "w"))
            mesh = await start_local_mesh(config, num_rollout=1, num_reference=0)
            try:
                cfg = load_config(RunConfig, data=mesh.config)
                if not endpoints:
                    with pytest.raises(ValueError, match="cannot take weight updates") as err:
                        await open_context("refused", cfg)
                    assert "rollout.servers" in str(err.value) and "grpo" in str(err.value)
                    return
                ctx = await open_context("trains", cfg)
                metrics = await loop.rl_step(ctx)
                await ctx.close()
                assert metrics["weight_version"] == 1
                assert (await remote.info(up_stub)).weight_version == 1       # the upstream took the weights
            finally:
                await mesh.stop()

    asyncio.run(main())
