"""Episodes keep their KV between turns on the paged cache (services/rollout/engine_torch/paged/pins.py): a turn with
an episode id pins its whole table, so the next turn feeds only its new tokens even after other calls evicted the
prefix cache; pins go at the episode's end, at a weight change and past their budget; the plumbing from the episode
runner and the proxy sessions to the engine."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from services.common.tensors.modeling import response_logprobs
from services.rollout.agents.episodes import AGENT_LOOPS, EpisodeRunner
from services.rollout.agents.sessions import SessionStore
from services.rollout.config import AgentConfig, RolloutSettings
from services.rollout.engine_torch.engine import TorchEngine
from services.rollout.engine_torch.paged.kv import block_bytes
from services.rollout.engine_torch.paged.pins import PIN_SHARE
from services.rollout.testing import Gate, make_tiny_model, random_state_like
from services.rollout.types import EpisodePrompt, GenerateBatch, PromptInput, SamplingParams

BS = 4                                              # tokens per block
POOL = 40                                           # blocks: pins may hold 20
PROMPT = [7, 3, 9, 12, 8, 10, 11, 14, 16, 4, 4, 5]
TOOL = [21, 22, 23]                                 # each turn's "tool response"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("pin_model"), max_position_embeddings=256)


def engine_of(path: str, blocks: int = POOL) -> TorchEngine:
    probe = TorchEngine(RolloutSettings(model={"path": path}))
    gib = blocks * block_bytes(probe.model, BS) / 2**30
    return TorchEngine(RolloutSettings(model={"path": path}, rollout=dict(kv_cache="paged", kv_block_size=BS,
                                                                          kv_cache_gib=gib)))


def turn(engine, ids, episode="", max_tokens=6):
    batch = GenerateBatch([PromptInput(prompt_ids=list(ids), episode_id=episode)],
                          SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return asyncio.run(engine.generate(batch))[0].samples[0]


def pressure(engine):
    """Other calls that fill the pool: every block the LRU keeps is evicted by their prompts and tokens."""
    prompts = [[25 + i] + [(i * 7 + k) % 29 + 3 for k in range(15)] for i in range(6)]
    batch = GenerateBatch([PromptInput(prompt_ids=p) for p in prompts], SamplingParams(temperature=1.0, seed=5,
                                                                                       max_tokens=8))
    asyncio.run(engine.generate(batch))


def play(engine, episode: str, turns: int = 4, *, squeeze: bool = True):
    """An episode of `turns` greedy turns, each history + a tool response, other calls between turns; per turn
    (prompt, sample, prefill tokens it cost)."""
    ids, out = list(PROMPT), []
    for t in range(turns):
        before = engine.info()["prefill_tokens"]
        s = turn(engine, ids, episode)
        out.append((list(ids), s, engine.info()["prefill_tokens"] - before))
        ids = ids + s.response_ids + TOOL
        if squeeze:
            pressure(engine)
    return out


def test_a_pinned_episode_prefills_only_its_new_tokens_each_turn_under_memory_pressure(model_dir):
    eng = engine_of(model_dir)
    turns = play(eng, "ep-1")
    fed = [cost for _, _, cost in turns]
    # Turn 1 feeds its prompt; each later turn the last sampled token (its KV was never computed) and the tool's.
    assert fed == [len(PROMPT)] + [1 + len(TOOL)] * 3
    m = eng.info()
    assert m["episode_pin_hits"] == 3 and m["evicted_blocks"] > 0 and m["episode_unpins"] == 0
    assert [s.cached_prompt_tokens for _, s, _ in turns[1:]] == [len(p) - 1 - len(TOOL) for p, _, _ in turns[1:]]
    # Without an episode id the same pressure evicts the history: later turns recompute some of it.
    plain = [cost for _, _, cost in play(engine_of(model_dir), "")]
    assert sum(plain[1:]) > sum(fed[1:])
    # Each turn's log-probs are the raw model's over the whole history (a full forward).
    lp, _ = response_logprobs(eng.model, [p for p, _, _ in turns], [s.response_ids for _, s, _ in turns],
                              pad_id=eng.pad_id)
    for i, (_, s, _) in enumerate(turns):
        assert torch.allclose(torch.tensor(s.logprobs), lp[i, :len(s.response_ids)], atol=1e-4, rtol=0), i


def test_pins_go_at_the_episodes_end_and_at_a_weight_change(model_dir):
    eng = engine_of(model_dir)
    play(eng, "ep-a", turns=2, squeeze=False)
    play(eng, "ep-b", turns=2, squeeze=False)
    m = eng.info()
    assert m["pinned_episodes"] == 2 and m["kv_blocks_pinned"] == m["kv_blocks_used"] > 0
    eng.end_episode("ep-a")
    m = eng.info()
    assert m["pinned_episodes"] == 1 and 0 < m["kv_blocks_used"] == m["kv_blocks_pinned"]
    eng.end_episode("ep-a")                          # twice, or one never seen: nothing happens
    eng.end_episode("never")
    asyncio.run(eng.apply_update(1, random_state_like(eng.model, seed=3)))
    m = eng.info()
    assert m["pinned_episodes"] == 0 and m["kv_blocks_used"] == 0 and m["kv_blocks_pinned"] == 0
    # ep-b's next turn: nothing of the old weights' KV is reused.
    history = PROMPT + [3] * 5
    before = eng.info()["prefill_tokens"]
    s = turn(eng, history, "ep-b")
    assert eng.info()["prefill_tokens"] - before == len(history) and s.cached_prompt_tokens == 0


def test_pins_stay_within_their_budget_and_unpin_the_least_recent_episode(model_dir):
    eng = engine_of(model_dir)
    budget = int(POOL * PIN_SHARE)
    for e in range(5):                               # 5 histories of ~5 blocks: more than 20 blocks pinned
        turn(eng, [25 + e] + PROMPT + [e] * 7, f"ep-{e}")
    m = eng.info()
    assert m["episode_unpins"] >= 1 and m["kv_blocks_pinned"] <= budget
    assert eng._paged.pins.take("ep-0", [0] * 99, eng.weight_version) is None     # the oldest went first
    assert m["pinned_episodes"] == 5 - m["episode_unpins"]


def test_a_pool_that_cannot_hold_a_row_beside_the_pins_unpins_them(model_dir):
    eng = engine_of(model_dir, blocks=12)            # pins may hold 6 blocks
    turn(eng, PROMPT, "small")                       # 12 + 6 tokens pinned: 5 blocks
    long = list(range(3, 30)) + list(range(3, 12))  # 36 tokens + 6 new: 11 blocks
    s = turn(eng, long, max_tokens=6)
    assert len(s.response_ids) == 6
    m = eng.info()
    assert m["episode_unpins"] == 1 and m["pinned_episodes"] == 0


def test_an_episode_that_ends_while_a_decode_runs_is_let_go_after_it(model_dir):
    eng = engine_of(model_dir)
    turn(eng, PROMPT, "busy")
    holding, go = threading.Event(), threading.Event()

    def hold():                                      # a decode in another thread holds the decoder
        with eng._paged._busy:
            holding.set()
            go.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    assert holding.wait(30)
    eng.end_episode("busy")
    assert eng.info()["pinned_episodes"] == 1       # queued, not touched under the running decode
    go.set()
    t.join()
    turn(eng, [5, 6, 7])                             # the next decode lets it go first
    assert eng.info()["pinned_episodes"] == 0


async def _turn_with_update(eng, ids, mode: str):
    """A turn of episode "ep" (8 greedy tokens, partial rollouts `mode`) with a weight update posted during its
    third model call."""
    gate = Gate(eng.model.model.embed_tokens, (3,))
    try:
        batch = GenerateBatch([PromptInput(prompt_ids=list(ids), episode_id="ep")],
                              SamplingParams(temperature=0.0, max_tokens=8), partial_rollout=mode)
        gen = asyncio.ensure_future(eng.generate(batch))
        await gate.wait(3)
        update = asyncio.ensure_future(eng.apply_update(1, random_state_like(eng.model, seed=4)))
        await asyncio.sleep(0)                       # the update posts its swap
        gate.open(3)
        await update
        return (await gen)[0].samples[0]
    finally:
        gate.handle.remove()


@pytest.mark.parametrize("mode", ["continue", "pause"])
def test_a_partial_rollout_turn_keeps_its_pin_only_when_its_kv_is_the_new_weights(model_dir, mode):
    eng = engine_of(model_dir)
    eng._paged.sync_every = 1            # windows of one step: the swap lands right after the gated call's step
    first = turn(eng, PROMPT, "ep")
    history = PROMPT + first.response_ids + TOOL
    s = asyncio.run(_turn_with_update(eng, history, mode))
    # Call 3 computed token 2's logits with the old weights; the swap landed before the next step.
    assert s.weight_versions == [0] * 3 + [1] * 5 and eng.stats["swaps_mid_generation"] == 1
    m = eng.info()
    assert m["episode_pin_hits"] == 1                # the turn started from its pin (version 0 then)
    if mode == "continue":
        # Its KV mixes both versions: neither cached nor pinned as version 1's; the next turn recomputes it all.
        assert m["pinned_episodes"] == 0 and m["kv_blocks_used"] == 0
        expect = len(history) + len(s.response_ids) + len(TOOL)
    else:
        # pause recomputed its KV with the new weights: pinned, and the next turn feeds only its new tokens.
        assert m["pinned_episodes"] == 1 and m["swap_recomputed_rows"] == 1
        expect = 1 + len(TOOL)
    before = eng.info()["prefill_tokens"]
    turn(eng, history + s.response_ids + TOOL, "ep")
    assert eng.info()["prefill_tokens"] - before == expect


async def _four_turns(ctx, prompt, sampling):
    rec = ctx.recorder(ctx.prompt_ids(prompt))
    for t in range(4):
        rec.add_sampled(await ctx.generate(rec.context_ids, max_tokens=5))
        if t < 3:
            rec.add_observation(TOOL)
    return rec.finish("max_turns", ctx.tokenizer)


def test_the_episode_runner_names_each_turns_episode_and_ends_it(model_dir, monkeypatch):
    monkeypatch.setitem(AGENT_LOOPS, "four_turns", _four_turns)
    eng = engine_of(model_dir, blocks=80)            # room to pin all three (~10 blocks each)
    runner = EpisodeRunner(eng, None, AgentConfig(name="single_turn"), max_tokens=5)
    groups = asyncio.run(runner.run([EpisodePrompt(id="q", text="12+7=", agent_name="four_turns")],
                                    SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=5), runner.defaults))
    episodes = groups[0].episodes
    assert [e.num_turns for e in episodes] == [4, 4, 4]
    m = eng.info()
    # every later turn of every episode started from its pin
    assert m["episode_pin_hits"] == 3 * 3 and m["episode_unpins"] == 0
    assert m["pinned_episodes"] == 0 and m["kv_blocks_used"] == 0      # all ended
    # Prefilled: the first turns' prompt (once, or its uncached tail again when their calls did not coalesce),
    # then per later turn 1 sampled token + the tool's.
    prompt = len(episodes[0].prompt_ids)
    assert prompt <= m["prefill_tokens"] - 3 * 3 * (1 + len(TOOL)) < 2 * prompt


def test_sessions_tell_the_engine_when_they_go():
    ended: list[str] = []
    store = SessionStore(max_sessions=2, ttl_s=3600, on_end=ended.append)
    for sid in ("a", "b", "c"):                      # c pushes a out
        store.open(sid)
    store.drop("b")
    store.forget("c")
    store.forget("c")
    assert ended == ["session:a", "session:b", "session:c"]
    assert store.open("d").kv_id == "session:d"
