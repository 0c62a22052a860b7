"""Partial rollouts through a real rollout server: an UpdateWeights stream that arrives while a Generate decodes
returns before the generation ends, and the Generate answer tags each token with its weight version."""

from __future__ import annotations

import asyncio
import threading

import pytest

from meshrl.v1 import rollout_pb2, rollout_pb2_grpc
from services.common.rpc.channel import create_channel
from services.rollout import convert
from services.rollout.config import RolloutSettings
from services.rollout.servicer import start
from services.rollout.testing import make_tiny_model, random_state_like
from services.rollout.weights_client import weight_messages

PROMPTS = [[4, 5, 13, 6, 15], [7, 3, 9, 12, 8]]
MAX_TOKENS, SWAP_AT_CALL, HOLD_AT_CALL = 40, 8, 25


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("partial_rpc_model"), max_position_embeddings=128)


class Posted(list):
    """The engine's swap list, with an event set when an update posts its swap."""

    def __init__(self):
        super().__init__()
        self.event = asyncio.Event()

    def append(self, item) -> None:
        super().append(item)
        self.event.set()


def test_an_update_stream_lands_inside_a_running_generate_and_the_answer_carries_token_versions(model_dir):
    async def main():
        mesh, port, replica = await start(RolloutSettings(model={"path": model_dir}), "127.0.0.1:0")
        engine = replica.engine
        calls, reached, opened = [0], {c: threading.Event() for c in (SWAP_AT_CALL, HOLD_AT_CALL)}, \
            {c: threading.Event() for c in (SWAP_AT_CALL, HOLD_AT_CALL)}

        def hook(module, args):
            calls[0] += 1
            if calls[0] in reached:
                reached[calls[0]].set()
                assert opened[calls[0]].wait(timeout=120)

        handle = engine.model.register_forward_pre_hook(hook)
        channel = create_channel(f"127.0.0.1:{port}", timeout=120)
        stub = rollout_pb2_grpc.RolloutStub(channel)
        try:
            request = rollout_pb2.GenerateRequest(
                prompts=[rollout_pb2.Prompt(id=f"p{i}", prompt_ids=p) for i, p in enumerate(PROMPTS)],
                sampling=rollout_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=MAX_TOKENS, seed=3),
                columnar=True, partial_rollout="continue")
            gen = asyncio.ensure_future(stub.Generate(request))
            assert await asyncio.to_thread(reached[SWAP_AT_CALL].wait, 120)
            engine._swaps = posted = Posted()     # the decode thread waits in the hook: it holds no swap list now
            msgs = list(weight_messages(random_state_like(engine.model, seed=4), version=1, bucket_bytes=4096))
            update = asyncio.ensure_future(stub.UpdateWeights(iter(msgs)))
            await posted.event.wait()            # the stream arrived whole and its swap waits for a step boundary
            opened[SWAP_AT_CALL].set()
            reply = await update
            returned_early = not gen.done()      # the generation is held at HOLD_AT_CALL meanwhile
            opened[HOLD_AT_CALL].set()
            return reply, returned_early, convert.results_from_pb(await gen)
        finally:
            handle.remove()
            await channel.close()
            await mesh.stop(0)
            await replica.close()

    reply, returned_early, results = asyncio.run(main())
    assert reply.weight_version == 1 and returned_early
    samples = [s for r in results for s in r.samples]
    assert len(samples) == len(PROMPTS) * 2
    for s in samples:
        n = len(s.response_ids)
        assert s.weight_version == 0 and s.weight_versions == [0] * SWAP_AT_CALL + [1] * (n - SWAP_AT_CALL)
