"""A vLLM replica started with enable_lora takes the trainer's adapter-only weight sync over the real gRPC path
(services/trainer/weights/adapter.py -> rollout UpdateWeights -> VLLMEngine.load_adapter), then samples and scores
under the pushed adapter at the trainer's log-probs; a named adapter pushed beside it is unloaded when the trainer
deletes it (UnloadAdapter -> vLLM's remove_lora); the OpenAI-compatible API serves the adapter as a model.

Slow: vLLM starts in 30-150 s on a shared 2-core machine. Skipped when vLLM cannot be imported."""

from __future__ import annotations

import asyncio
import importlib.util
import json

import pytest

from meshrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from services.common.config import load_config
from services.common.rpc.channel import create_channel
from services.rollout import convert as rollout_convert
from services.rollout.types import GenerateBatch, PromptInput, SamplingParams
from services.trainer.testing import random_samples
from tests.integration.test_adapter_sync import logprobs_request, train_once

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")]

ATOL = 1e-3
PROMPTS = [[1, 4, 5, 13, 6, 15], [1, 9, 8, 7, 12]]


async def _sampled_gap(trainer, rollout, adapter: str) -> tuple[float, list[int]]:
    """Samples under `adapter` on the replica; the largest gap between their log-probs and the trainer's on the
    same tokens, and the samples' weight versions."""
    batch = GenerateBatch([PromptInput(prompt_ids=p) for p in PROMPTS],
                          SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=3, adapter=adapter))
    results = rollout_convert.results_from_pb(await rollout.Generate(rollout_convert.request_to_pb(batch)))
    seqs = [(r.prompt_ids, s) for r in results for s in r.samples]
    want = await trainer.ComputeLogProbs(common_pb2.LogProbsRequest(sequences=[
        common_pb2.TokenSequence(id=str(i), prompt_ids=p, response_ids=s.response_ids)
        for i, (p, s) in enumerate(seqs)], temperature=1.0))
    gap = max(max(abs(a - b) for a, b in zip(s.logprobs, w.logprobs, strict=True))
              for (_, s), w in zip(seqs, want.results, strict=True))
    return gap, [s.weight_version for _, s in seqs]


def _check_round(pushed, want, got, base, sampled) -> None:
    """One push: the adapter alone reached the replica, which scores and samples under it at the trainer's
    log-probs (and not at the base's)."""
    sampled_gap, versions = sampled
    r = pushed.results[0]
    assert r.ok, r.error
    assert (r.payload, r.adapter) == ("adapter", "default")      # the adapter alone, over the same base
    assert set(versions) == {pushed.weight_version}
    gap_to_base = 0.0
    for g, w, b in zip(got.results, want.results, base.results, strict=True):
        assert list(g.logprobs) == pytest.approx(list(w.logprobs), abs=ATOL)
        gap_to_base = max(gap_to_base, max(abs(x - y) for x, y in zip(b.logprobs, w.logprobs)))
    assert gap_to_base > 10 * ATOL       # the adapter changes the policy: the base would fail the above
    assert sampled_gap < ATOL


async def _over_http(port: int, trainer) -> tuple:
    """The adapter as a model over the replica's OpenAI-compatible API (official client): /v1/models, and a
    completion under it whose log-probs are the trainer's."""
    import openai

    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                                  timeout=120) as client:
        models = await client.models.list()
        resp = await client.completions.create(model="default", prompt=PROMPTS[0], n=2, max_tokens=6, logprobs=0,
                                               seed=4, extra_body={"return_token_ids": True})
    want = await trainer.ComputeLogProbs(common_pb2.LogProbsRequest(sequences=[
        common_pb2.TokenSequence(id=str(i), prompt_ids=PROMPTS[0], response_ids=c.model_extra["token_ids"])
        for i, c in enumerate(resp.choices)], temperature=1.0))
    gap = max(max(abs(a - b) for a, b in zip(c.logprobs.token_logprobs, w.logprobs, strict=True))
              for c, w in zip(resp.choices, want.results, strict=True))
    return [(m.id, m.model_extra.get("weight_version")) for m in models.data], resp.model, gap


async def _adapters(rollout) -> dict:
    return json.loads((await rollout.GetInfo(common_pb2.GetInfoRequest())).details["adapters"])


def test_a_vllm_replica_takes_adapter_pushes_samples_at_the_trainers_logprobs_and_unloads_deleted_ones(tmp_path):
    from services.rollout.config import RolloutSettings
    from services.rollout.servicer import start as start_rollout
    from services.rollout.testing import make_tiny_model
    from services.trainer.config import TrainerSettings
    from services.trainer.servicer import start as start_trainer

    # head_dim 32: vLLM's CPU attention supports 32, 64, 80, ... only.
    model = make_tiny_model(tmp_path / "model", hidden_size=128, max_position_embeddings=256)
    samples = random_samples(3, vocab_size=32)

    async def main():
        settings = load_config(TrainerSettings, data={"model": {"path": model}, "actor": {
            "lr": 5e-2, "lora": {"rank": 4, "alpha": 8}}})
        server, port, engine = await start_trainer(settings, "127.0.0.1:0")
        rs = RolloutSettings(model={"path": model}, rollout={
            "engine": "vllm", "gpu_memory_utilization": 0.05, "max_batch_size": 16, "http_port": 0,
            "served_model_name": "tiny",
            "vllm_engine_args": {"enable_lora": True, "max_lora_rank": 8}})
        r_server, r_port, replica = await start_rollout(rs, "127.0.0.1:0")
        target = f"127.0.0.1:{r_port}"
        out = {}
        try:
            async with create_channel(f"127.0.0.1:{port}") as ch, create_channel(target) as rch:
                trainer, rollout = trainer_pb2_grpc.TrainerStub(ch), rollout_pb2_grpc.RolloutStub(rch)
                for step in (1, 2):
                    await train_once(trainer, samples)
                    pushed = await trainer.PushWeights(trainer_pb2.PushWeightsRequest(targets=[target]))
                    want = await trainer.ComputeLogProbs(logprobs_request(samples))
                    got = await rollout.ComputeLogProbs(logprobs_request(samples, "default"))
                    base = await rollout.ComputeLogProbs(logprobs_request(samples))
                    out[step] = (pushed, want, got, base, await _sampled_gap(trainer, rollout, "default"))
                out["http"] = await _over_http(replica.http_port, trainer)
                await trainer.CreateAdapter(trainer_pb2.AdapterRequest(name="client-0"))
                named = await trainer.PushWeights(trainer_pb2.PushWeightsRequest(targets=[target], adapter="client-0"))
                out["both"] = await _adapters(rollout)
                out["deleted"] = await trainer.DeleteAdapter(trainer_pb2.AdapterRequest(name="client-0"))
                out["left"] = await _adapters(rollout)
                out["named"] = named
                out["again"] = await rollout.UnloadAdapter(rollout_pb2.UnloadAdapterRequest(name="client-0"))
        finally:
            await r_server.stop(0)
            await replica.close()
            await server.stop(0)
            engine.close()
        return target, out

    target, out = asyncio.run(main())
    for step in (1, 2):
        _check_round(*out[step])
    assert out[2][0].results[0].ok and out[2][0].weight_version > out[1][0].weight_version
    models, answered_as, http_gap = out["http"]
    assert models == [("tiny", out[2][0].weight_version), ("default", out[2][0].weight_version)]
    assert answered_as == "default" and http_gap < ATOL
    assert out["named"].results[0].ok, out["named"].results[0].error
    assert set(out["both"]) == {"default", "client-0"}
    assert dict(out["deleted"].unloaded) == {target: "unloaded"}
    assert set(out["left"]) == {"default"}
    assert not out["again"].unloaded and list(out["again"].adapters) == ["default"]
