"""A weight swap whose caller is cancelled while the swap runs leaves weights and version in step."""

import asyncio
import time

import pytest
import torch

from services.common.config import load_config
from services.common.weights import build_manifest, iter_buckets, named_weights
from services.rollout import torch_engine as rollout_engine
from services.rollout.config import RolloutSettings
from services.rollout.torch_engine import TorchEngine

PROMPT, RESPONSE = [1, 5, 14, 6, 16], [7, 2]


def test_a_swap_cancelled_midway_leaves_the_replica_on_one_version_with_its_own_weights(arith_model_path,
                                                                                      monkeypatch):
    engine = TorchEngine(load_config(RolloutSettings, data={"model": {"path": arith_model_path}}))
    state = {k: (v.detach() + 0.05).contiguous() for k, v in named_weights(engine.model).items()}
    real_swap = rollout_engine.swap_in

    def slow_swap(*args, **kwargs):
        time.sleep(0.5)                         # the caller is cancelled meanwhile
        return real_swap(*args, **kwargs)

    monkeypatch.setattr(rollout_engine, "swap_in", slow_swap)

    async def buckets():
        for data, crc in iter_buckets(state, 1 << 20):
            yield data, crc

    async def main():
        before = (await engine.logprobs([PROMPT], [RESPONSE]))[0][0]
        task = asyncio.create_task(engine.update_weights(build_manifest(state, 7), buckets()))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        after, version = await engine.logprobs([PROMPT], [RESPONSE])
        return before, after[0], version

    before, after, version = asyncio.run(main())
    # Either the update landed (new weights, version 7) or it did not (old weights, version 0).
    assert (version, after == before) in ((7, False), (0, True)), (version, after == before)
