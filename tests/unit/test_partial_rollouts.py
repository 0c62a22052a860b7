"""Partial rollouts in the torch engine: a weight update lands between two decode steps of a running generation (on
the paged KV cache, between two windows of steps), the rows go on with the new weights (over the old KV cache, or a
recomputed one: pause), and each token carries the version that produced it; on today's decode loop and on the paged
KV cache (rollout.kv_cache: paged)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from meshrl.v1 import rollout_pb2
from services.common.tensors.modeling import response_logprobs
from services.rollout import convert
from services.rollout.config import RolloutSettings
from services.rollout.engine_torch.engine import TorchEngine
from services.rollout.testing import Gate, make_tiny_model, random_state_like
from services.rollout.types import GenerateBatch, PromptInput, PromptResult, SampleResult, SamplingParams

PROMPTS = [[4, 5, 13, 6, 15], [7, 3, 9, 12, 8], [20, 21]]
MAX_TOKENS = 40
SWAP_AT_CALL = 10          # the model call (1 = prefill) during which the update arrives
HOLD_AT_CALL = 30          # a later call the generation waits at until the test saw the update return


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("partial_model"), max_position_embeddings=128)


def batch(partial: str) -> GenerateBatch:
    return GenerateBatch([PromptInput(id=f"p{i}", prompt_ids=list(p)) for i, p in enumerate(PROMPTS)],
                         SamplingParams(n=2, temperature=1.0, max_tokens=MAX_TOKENS, seed=7), partial_rollout=partial)


def samples_of(results: list[PromptResult]) -> list[SampleResult]:
    return [s for r in results for s in r.samples]


async def generate_with_update_at(engine: TorchEngine, mode: str, new_weights) -> tuple[list, bool]:
    """Generates, posting a weight update during model call SWAP_AT_CALL; returns the samples and whether the
    update returned while the generation was still held at HOLD_AT_CALL."""
    partial = mode != "off"
    # The embedding runs once per model call on both paths (the paged one calls the model's modules, not forward).
    gate = Gate(engine.model.model.embed_tokens, (SWAP_AT_CALL, HOLD_AT_CALL) if partial else (SWAP_AT_CALL,))
    try:
        gen = asyncio.ensure_future(engine.generate(batch(mode)))
        await gate.wait(SWAP_AT_CALL)
        update = asyncio.ensure_future(engine.apply_update(1, new_weights))
        await asyncio.sleep(0)                     # one loop turn: the update posts its swap (no timing)
        assert len(engine._swaps) == 1
        gate.open(SWAP_AT_CALL)
        if partial:
            await update                           # landed at the next step boundary ...
            returned_early = not gen.done()        # ... while the generation is held further on
            gate.open(HOLD_AT_CALL)
            return samples_of(await gen), returned_early
        results = samples_of(await gen)
        await update
        return results, False
    finally:
        gate.handle.remove()


@pytest.mark.parametrize("kv_cache", ["none", "paged"])
@pytest.mark.parametrize("mode", ["continue", "pause"])
def test_a_weight_update_lands_mid_generation_and_versions_switch_once_at_the_swap(model_dir, mode, kv_cache):
    engine = TorchEngine(RolloutSettings(model={"path": model_dir}, rollout={"kv_cache": kv_cache}))
    if kv_cache == "paged":
        engine._paged.sync_every = 16       # windows that end before HOLD_AT_CALL (the default 32 would not)
    reference = samples_of(asyncio.run(engine.generate(batch(mode))))      # no update: all version 0
    assert all(s.weight_versions is None and s.weight_version == 0 for s in reference)
    old = {k: v.clone() for k, v in engine.model.state_dict().items()}
    new = random_state_like(engine.model, seed=1)
    samples, returned_early = asyncio.run(generate_with_update_at(engine, mode, new))
    assert returned_early, "the update waited for the generation to end"
    assert engine.weight_version == 1 and engine.stats["swaps_mid_generation"] == 1
    # Call c (c >= 2) computes the logits of token c - 1, so token SWAP_AT_CALL is the first of the new weights.
    switch = SWAP_AT_CALL
    if kv_cache == "paged":
        # The paged cache decodes windows of W steps (paged/window.py): call c feeds token c - 2, in window
        # (c - 2) // W; the swap lands at that window's end, and the tokens after it are the new weights'.
        W = engine._paged.sync_every
        switch = ((SWAP_AT_CALL - 2) // W + 1) * W
        assert switch < HOLD_AT_CALL - 2 and engine._paged.stats["decode_syncs"] < engine._paged.stats["decode_steps"]
    assert len(samples) == len(reference) == len(PROMPTS) * 2
    assert all(len(ref.response_ids) > switch for ref in reference)
    for s, ref in zip(samples, reference):
        n = len(s.response_ids)
        assert len(s.logprobs) == len(s.weight_versions) == n
        assert n == MAX_TOKENS or (s.finish_reason == "stop" and s.response_ids[-1] == 2)   # length, or eos
        assert s.weight_versions == [0] * switch + [1] * (n - switch)
        assert s.weight_version == 0                                    # the oldest
        # Nothing lost or duplicated at the swap: the tokens before it are the unswapped run's, in order.
        assert s.response_ids[:switch] == ref.response_ids[:switch]
        assert s.logprobs[:switch] == pytest.approx(ref.logprobs[:switch], abs=1e-5)
    # The new weights decode the rest: the continuations differ from the old weights'.
    assert any(s.response_ids[switch:] != ref.response_ids[switch:] for s, ref in zip(samples, reference))
    if mode == "pause":
        # The KV cache was recomputed by the new weights: every token after the swap has the new model's
        # log-prob given the whole prefix (continue would differ: its cache holds the old weights' keys).
        new_lp = teacher_forced(engine, samples)
        for s, lp in zip(samples, new_lp):
            assert s.logprobs[switch:] == pytest.approx(lp[switch:len(s.response_ids)], abs=1e-4)
        engine.model.load_state_dict(old)
        old_lp = teacher_forced(engine, samples)
        for s, lp in zip(samples, old_lp):
            assert s.logprobs[:switch] == pytest.approx(lp[:switch], abs=1e-4)


def teacher_forced(engine: TorchEngine, samples: list[SampleResult]) -> list[list[float]]:
    prompts = [p for p in PROMPTS for _ in range(2)]
    with torch.no_grad():
        lp, _ = response_logprobs(engine.model, prompts, [s.response_ids for s in samples], pad_id=engine.pad_id)
    return lp.tolist()


@pytest.mark.parametrize("kv_cache", ["none", "paged"])
def test_without_partial_rollouts_the_update_waits_for_the_generation(model_dir, kv_cache):
    engine = TorchEngine(RolloutSettings(model={"path": model_dir}, rollout={"kv_cache": kv_cache}))
    samples, _ = asyncio.run(generate_with_update_at(engine, "off", random_state_like(engine.model, seed=2)))
    assert all(s.weight_versions is None and s.weight_version == 0 for s in samples)
    assert engine.weight_version == 1 and engine.stats["swaps_mid_generation"] == 0


def test_per_token_versions_travel_on_the_wire_and_a_bad_list_is_refused_by_name():
    s = SampleResult(response_ids=[5, 6, 7], logprobs=[-1.0, -2.0, -3.0], text="abc", finish_reason="length",
                     weight_version=3, weight_versions=[3, 4, 4])
    plain = SampleResult(response_ids=[5], logprobs=[-1.0], text="a", finish_reason="stop", weight_version=4)
    results = [PromptResult("p", [1, 2], [s, plain])]
    for columnar in (False, True):
        back = convert.results_from_pb(convert.results_to_pb(results, columnar=columnar))
        assert [x.weight_versions for x in back[0].samples] == [[3, 4, 4], None]
    bad = convert.results_to_pb(results)
    del bad.responses[0].samples[0].weight_versions[:]
    bad.responses[0].samples[0].weight_versions.extend([4, 4, 4])
    with pytest.raises(ValueError, match=r"responses\[0\].samples.weight_versions: 3 versions \(oldest 4\)"):
        convert.results_from_pb(bad)
    request = convert.request_to_pb(batch("pause"))
    assert isinstance(request, rollout_pb2.GenerateRequest)
    assert convert.request_from_pb(request, RolloutSettings().rollout).partial_rollout == "pause"
    request.partial_rollout = "sometimes"
    with pytest.raises(ValueError, match="partial_rollout: must be one of off, continue, pause, got 'sometimes'"):
        convert.request_from_pb(request, RolloutSettings().rollout)
