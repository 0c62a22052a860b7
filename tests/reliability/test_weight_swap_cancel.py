"""A weight swap whose caller is cancelled while the swap runs leaves weights and version in step."""

import asyncio
import threading

import pytest
import torch

from services.common.config import load_config
from services.common.tensors.weights import build_manifest, iter_buckets, named_weights
from services.rollout.config import RolloutSettings
from services.rollout.engine_torch import engine as rollout_engine
from services.rollout.engine_torch.engine import TorchEngine

PROMPT, RESPONSE = [1, 5, 14, 6, 16], [7, 2]


def test_a_swap_cancelled_midway_leaves_the_replica_on_one_version_with_its_own_weights(arith_model_path,
                                                                                      monkeypatch):
    engine = TorchEngine(load_config(RolloutSettings, data={"model": {"path": arith_model_path}}))
    state = {k: (v.detach() + 0.05).contiguous() for k, v in named_weights(engine.model).items()}
    real_swap = rollout_engine.swap_in
    in_swap, release = threading.Event(), threading.Event()

    def held_swap(*args, **kwargs):
        in_swap.set()
        assert release.wait(60)                 # the caller is cancelled meanwhile
        return real_swap(*args, **kwargs)

    monkeypatch.setattr(rollout_engine, "swap_in", held_swap)

    async def buckets():
        for data, crc in iter_buckets(state, 1 << 20):
            yield data, crc

    async def main():
        before = (await engine.logprobs([PROMPT], [RESPONSE]))[0][0]
        task = asyncio.create_task(engine.update_weights(build_manifest(state, 7), buckets()))
        assert await asyncio.to_thread(in_swap.wait, 60)   # the swap runs in its worker thread
        task.cancel()
        await asyncio.sleep(0)                             # the cancellation reaches the waiting caller
        assert not task.done()                             # ... which still waits for the swap's thread
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        after, version = await engine.logprobs([PROMPT], [RESPONSE])
        return before, after[0], version

    before, after, version = asyncio.run(main())
    # Cancelled once the swap had started: a thread cannot be stopped, so the update lands whole (new weights
    # under version 7) and the caller still sees its cancellation; never new weights under the old version.
    assert (version, after != before) == (7, True), (version, after == before)
