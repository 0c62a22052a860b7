"""Partial rollouts on the CUDA-graph decode (skipped without CUDA): a weight update lands at a sync window
boundary of a running graph decode, the rows go on with the new weights, and the per-token versions switch
once, where the new weights' logits begin."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from services.rollout.config import RolloutSettings
from services.rollout.engine_torch.engine import TorchEngine
from services.rollout.testing import make_tiny_model, random_state_like
from services.rollout.types import GenerateBatch, PromptInput, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[4, 5, 13, 6, 15], [7, 3, 9, 12, 8], [20, 21]]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("partial_gpu_model"), max_position_embeddings=512)


def batch() -> GenerateBatch:
    return GenerateBatch([PromptInput(id=f"p{i}", prompt_ids=list(p)) for i, p in enumerate(PROMPTS)],
                         SamplingParams(n=2, temperature=1.0, max_tokens=MAX_TOKENS, seed=7), partial_rollout="continue")


def test_a_weight_update_lands_between_graph_replays_and_versions_switch_once(model_dir):
    engine = TorchEngine(RolloutSettings(model={"path": model_dir, "device": "cuda", "dtype": "float32"},
                                         rollout={"cuda_graphs": True, "cuda_graph_compile": False,
                                                  "max_batch_size": 16}))
    reference = [s for r in asyncio.run(engine.generate(batch())) for s in r.samples]
    reached, opened = threading.Event(), threading.Event()
    between = engine._between_steps

    def gated(rows, first_token):             # the first window boundary waits until the update is posted
        if not reached.is_set():
            reached.set()
            assert opened.wait(timeout=120)
        return between(rows, first_token)

    engine._between_steps = gated

    async def main():
        gen = asyncio.ensure_future(engine.generate(batch()))
        assert await asyncio.to_thread(reached.wait, 120)
        update = asyncio.ensure_future(engine.apply_update(1, random_state_like(engine.model, seed=1)))
        await asyncio.sleep(0)                # one loop turn: the update posts its swap (no timing)
        assert len(engine._swaps) == 1
        opened.set()
        await update
        return [s for r in await gen for s in r.samples]

    samples = asyncio.run(main())
    # The boundary after step sync_every - 1: token sync_every was sampled from logits computed before it.
    switch = engine._graph_decoder.sync_every + 1
    assert engine.weight_version == 1 and engine.stats["swaps_mid_generation"] == 1
    for s, ref in zip(samples, reference):
        n = len(s.response_ids)
        if n <= switch:
            assert s.weight_versions is None
            continue
        assert s.weight_versions == [0] * switch + [1] * (n - switch) and s.weight_version == 0
        assert s.response_ids[:switch] == ref.response_ids[:switch]
