"""Partial rollouts of episodes (GenerateEpisodes): each model turn's engine call carries the request's
partial_rollout, so a weight update lands inside a turn's decode and the episode records every token's version;
with "off" the update waits for the turn."""

from __future__ import annotations

import asyncio

import pytest

from services.rollout import convert
from services.rollout.agents.episodes import EpisodeRunner
from services.rollout.config import AgentConfig, RolloutSettings
from services.rollout.engine_torch.engine import TorchEngine
from services.rollout.testing import Gate, make_tiny_model, random_state_like
from services.rollout.types import EpisodePrompt, SamplingParams

MAX_TOKENS = 40
SWAP_AT_CALL = 10          # the model call (1 = prefill) during which the update arrives
HOLD_AT_CALL = 30          # a later call the turn waits at until the test saw the update return


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("partial_episode_model"), max_position_embeddings=256)


async def episodes_with_update(engine: TorchEngine, mode: str):
    """Two single-turn episodes (one engine call: unseeded, same sampling), a weight update posted during model call
    SWAP_AT_CALL; the episodes and whether the update returned while the turn was still held."""
    runner = EpisodeRunner(engine, None, AgentConfig(name="single_turn"), max_tokens=MAX_TOKENS)
    # The embedding runs once per model call on today's loop and on the paged KV cache (which never calls forward).
    gate = Gate(engine.model.model.embed_tokens, (SWAP_AT_CALL, HOLD_AT_CALL))
    try:
        play = asyncio.ensure_future(runner.run([EpisodePrompt(id="q", text="12+7=")],
                                                SamplingParams(n=2, temperature=1.0, max_tokens=MAX_TOKENS),
                                                runner.defaults, partial_rollout=mode))
        assert await asyncio.to_thread(gate.reached[SWAP_AT_CALL].wait, 120)
        update = asyncio.ensure_future(engine.apply_update(1, random_state_like(engine.model, seed=1)))
        await asyncio.sleep(0)                     # one loop turn: the update posts its swap (no timing)
        gate.opened[SWAP_AT_CALL].set()
        if mode == "off":                          # the update waits for the turn: let the turn run to its end
            gate.opened[HOLD_AT_CALL].set()
            groups = await play
            await update
            return groups[0].episodes, False
        await update
        returned_early = not play.done()
        gate.opened[HOLD_AT_CALL].set()
        return (await play)[0].episodes, returned_early
    finally:
        gate.handle.remove()


@pytest.mark.parametrize("mode", ["continue", "pause"])
def test_an_update_lands_inside_an_episodes_turn_and_the_episode_records_each_tokens_version(model_dir, mode):
    engine = TorchEngine(RolloutSettings(model={"path": model_dir}))
    episodes, returned_early = asyncio.run(episodes_with_update(engine, mode))
    assert returned_early, "the update waited for the episode's turn to end"
    assert engine.weight_version == 1 and engine.stats["swaps_mid_generation"] == 1
    for ep in episodes:
        n = len(ep.response_ids)
        assert n > SWAP_AT_CALL and ep.loss_mask == [1] * n
        # call c (c >= 2) computes the logits of token c - 1: token SWAP_AT_CALL is the new weights' first
        assert ep.weight_versions == [0] * SWAP_AT_CALL + [1] * (n - SWAP_AT_CALL)


def test_without_partial_rollouts_the_update_waits_for_the_episodes_turn(model_dir):
    engine = TorchEngine(RolloutSettings(model={"path": model_dir}))
    episodes, _ = asyncio.run(episodes_with_update(engine, "off"))
    assert engine.weight_version == 1 and engine.stats["swaps_mid_generation"] == 0
    assert all(ep.weight_versions == [0] * len(ep.response_ids) for ep in episodes)


def test_the_mode_travels_in_the_episodes_request_and_a_bad_one_is_refused_by_name(model_dir):
    request = convert.episodes_request_to_pb([EpisodePrompt(id="q", text="1+1=")], SamplingParams(n=1),
                                             AgentConfig(name="single_turn"), "pause")
    assert request.partial_rollout == "pause"
    engine = TorchEngine(RolloutSettings(model={"path": model_dir}))
    runner = EpisodeRunner(engine, None, AgentConfig(name="single_turn"), max_tokens=4)
    with pytest.raises(ValueError, match="partial_rollout: must be one of off, continue, pause, got 'later'"):
        asyncio.run(runner.run([EpisodePrompt(id="q", text="1+1=")], SamplingParams(n=1), runner.defaults,
                               partial_rollout="later"))
