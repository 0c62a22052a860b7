"""The paged KV cache serves LoRA adapters (services/rollout/engine_torch/paged/ with lora.py): rows of two adapters and
the base in one batch get what the unpaged LoRA path gives them (prefill, eager and static graph steps, preempted
rows), the prefix cache, forks and episode pins are keyed by adapter as well as by tokens, and an adapter's reload
drops its cached blocks and pins but not the base's or another adapter's."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.rollout.config import RolloutSettings
from services.rollout.engine_torch.engine import TorchEngine, _Job
from services.rollout.engine_torch.paged.blocks import BlockPool, BlockTable, adapter_seed, chain_hashes
from services.rollout.engine_torch.paged.kv import block_bytes
from services.rollout.testing import Gate, make_tiny_model
from services.rollout.types import GenerateBatch, PromptInput, SamplingParams
from tests.unit.test_rollout_lora import PROMPTS, samples, trained_adapter

BS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("paged_lora_model"), max_position_embeddings=256)


@pytest.fixture(scope="module")
def adapters(model_dir):
    """Two trained adapters of different ranks, and a second version of the first: {name: (tensors, config)}."""
    out = {}
    for name, seed, rank in (("a", 10, 4), ("b", 11, 8), ("a2", 12, 4)):
        tensors, config, _ = trained_adapter(model_dir, seed=seed, rank=rank, alpha=8.0 * rank / 4)
        out[name] = (tensors, config)
    return out


def engine(model_dir, *, paged: bool, blocks: int | None = None, **rollout) -> TorchEngine:
    r = {"enable_lora": True, "max_loras": 3, "max_lora_rank": 8, **rollout}
    if paged:
        r.update(kv_cache="paged", kv_block_size=BS)
        if blocks is not None:
            probe = TorchEngine(RolloutSettings(model={"path": model_dir}))
            r["kv_cache_gib"] = blocks * block_bytes(probe.model, BS) / 2**30
    return TorchEngine(RolloutSettings(model={"path": model_dir}, rollout=r))


def load(eng, adapters, name: str, as_name: str | None = None, version: int = 1) -> None:
    tensors, config = adapters[name]
    eng.load_adapter(as_name or name, version, config, tensors)


def request(adapter: str, prompts=PROMPTS, episode: str = "", **sampling) -> GenerateBatch:
    p = SamplingParams(**{"temperature": 0.0, "max_tokens": 8, **sampling, "adapter": adapter})
    inputs = [PromptInput(id=f"p{i}", prompt_ids=list(q), episode_id=episode) for i, q in enumerate(prompts)]
    return GenerateBatch(inputs, p)


def assert_same(a, b):
    """Same tokens; log-probs within fp32 noise of two attention paths (the paged tests' 1e-4 against a full
    forward): the trained adapters' deltas are large, so the two summation orders differ by a few 1e-5."""
    for x, y in zip(samples(a), samples(b), strict=True):
        assert x.response_ids == y.response_ids
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=0)


def mixed(eng, requests):
    return eng._generate_jobs([_Job(b, eng.check_batch(b), None) for b in requests])


def cached_by_adapter(eng) -> dict[str | None, int]:
    """Cached blocks of the paged pool per adapter name (None: the base model's)."""
    pool = eng._paged.pool
    out: dict[str | None, int] = {}
    for b in pool._hash_of:
        a = pool._adapter.get(b)
        out[a[0] if a else None] = out.get(a[0] if a else None, 0) + 1
    return out


def static_graph_step(eng) -> None:
    """The paged graph path's static padded step without capture (CPU): slots copied into the bank's static rows."""
    from services.rollout.engine_torch.paged.graphs import PagedGraphs

    dec = eng._paged
    dec.graphs = PagedGraphs(eng.model, dec.kv, width=256 // BS, scratch_block=dec.pool.allocate(),
                             max_batch_size=eng.max_batch_size, use_graphs=False, kernel=False)
    assert dec.graphs.adapters is eng.adapters


@pytest.mark.parametrize("sampling,static", [(dict(), False), (dict(temperature=1.0, seed=3), False),
                                             (dict(), True), (dict(temperature=0.8, top_p=0.9, seed=4), True)])
def test_rows_of_two_adapters_and_the_base_in_one_paged_batch_get_the_unpaged_lora_outputs(model_dir, adapters,
                                                                                           sampling, static):
    plain, paged = engine(model_dir, paged=False), engine(model_dir, paged=True)
    assert paged._paged is not None and paged._paged.adapters is paged.adapters
    if static:
        static_graph_step(paged)
    for e in (plain, paged):
        load(e, adapters, "a")
        load(e, adapters, "b")
    requests = [request("a", n=2, **sampling), request("", **sampling), request("b", n=3, **sampling)]
    want, got = mixed(plain, requests), mixed(paged, requests)
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)
    # The adapters change the model (else the parity proves nothing), and each row got its own one.
    lp = [samples(g)[0].logprobs for g in got]
    assert lp[0] != lp[1] and lp[1] != lp[2] and lp[0] != lp[2]
    if static:
        assert not paged.adapters.rows.any()              # forwards after the decode read base rows
    assert paged.info()["kv_blocks_used"] == int(static)


def test_the_same_prompt_under_two_adapters_and_the_base_is_prefilled_for_each_and_never_shared(model_dir, adapters):
    plain, paged = engine(model_dir, paged=False), engine(model_dir, paged=True)
    for e in (plain, paged):
        load(e, adapters, "a")
        load(e, adapters, "b")
    prompt = [PROMPTS[1]]                                    # 12 tokens: 3 full blocks
    # One batch: the same tokens under three keys are three prefills (and a's 2 samples one of them, forked).
    requests = [request(x, prompts=prompt, n=2 if x == "a" else 1) for x in ("a", "b", "")]
    got = mixed(paged, requests)
    m = paged.info()
    assert m["prefill_tokens"] == 3 * len(PROMPTS[1]) and m["prefill_tokens_saved"] == len(PROMPTS[1])
    assert [[s.cached_prompt_tokens for s in samples(g)] for g in got] == [[0, 12], [0], [0]]
    for g, r in zip(got, requests):
        assert_same(g, plain.generate_sync(r))
    assert cached_by_adapter(paged) == {"a": 4, "b": 4, None: 4}     # prompt + response, full blocks, per key
    # Later calls, each alone: each finds its own blocks, never another key's, and samples its own adapter's tokens.
    for x in ("b", "", "a"):
        fed = paged.info()["prefill_tokens"]
        out = paged.generate_sync(request(x, prompts=prompt))
        assert samples(out)[0].cached_prompt_tokens == 8                # its 2 prompt blocks (the last token is fed)
        assert paged.info()["prefill_tokens"] - fed == len(PROMPTS[1]) - 8
        assert_same(out, plain.generate_sync(request(x, prompts=prompt)))


def test_an_adapters_reload_drops_its_blocks_and_pins_and_keeps_the_base_and_the_other_adapters(model_dir, adapters):
    plain, paged = engine(model_dir, paged=False), engine(model_dir, paged=True)
    for e in (plain, paged):
        load(e, adapters, "a")
        load(e, adapters, "b")
    prompt = [PROMPTS[1]]
    for x in ("a", "b", ""):
        paged.generate_sync(request(x, prompts=prompt))
    for x, episode in (("a", "ea"), ("b", "eb")):               # episode turns pin their tables
        asyncio.run(paged.generate(request(x, prompts=[PROMPTS[0]], episode=episode, max_tokens=5)))
    before, epoch = cached_by_adapter(paged), paged._paged._epoch
    m0 = paged.info()
    assert before["a"] > 0 and before["b"] > 0 and before[None] > 0 and m0["pinned_episodes"] == 2
    for e in (plain, paged):
        load(e, adapters, "a2", as_name="a", version=2)        # a's next version: other weights, same slot
    after = cached_by_adapter(paged)
    m1 = paged.info()
    assert "a" not in after and after["b"] == before["b"] and after[None] == before[None]
    assert m1["invalidated_blocks"] - m0["invalidated_blocks"] == before["a"]
    assert m1["pinned_episodes"] == 1                            # a's pin went, b's stays
    assert paged._paged._epoch == epoch and paged.weight_version == 2     # the base weights' KV tag did not move
    # b and the base still hit; a prefills in full and samples the new version's tokens.
    for x, hit in (("b", 8), ("", 8), ("a", 0)):
        out = paged.generate_sync(request(x, prompts=prompt))
        assert samples(out)[0].cached_prompt_tokens == hit, x
        assert_same(out, plain.generate_sync(request(x, prompts=prompt)))
    # b's episode's next turn starts from its pin; a's turn (pin gone) does not.
    hits = paged.info()["episode_pin_hits"]
    for x, episode in (("b", "eb"), ("a", "ea")):
        first = samples(plain.generate_sync(request(x, prompts=[PROMPTS[0]], max_tokens=5)))[0]
        history = [PROMPTS[0] + first.response_ids + [21, 22]]
        out = asyncio.run(paged.generate(request(x, prompts=history, episode=episode, max_tokens=4)))
        assert_same(out, plain.generate_sync(request(x, prompts=history, max_tokens=4)))
    assert paged.info()["episode_pin_hits"] == hits + 1
    # Unloading b drops its blocks and its pin too.
    assert paged.unload_adapter("b")
    assert "b" not in cached_by_adapter(paged) and paged.info()["pinned_episodes"] == 1     # a's new turn's pin


def test_preempted_adapter_rows_resume_under_their_own_adapter(model_dir, adapters):
    plain, small = engine(model_dir, paged=False), engine(model_dir, paged=True, blocks=20)
    for e in (plain, small):
        load(e, adapters, "a")
        load(e, adapters, "b")
    sampling = dict(temperature=1.0, seed=5, max_tokens=16)
    prompts = [PROMPTS[0], PROMPTS[1]]
    requests = [request(x, prompts=prompts, n=2, **sampling) for x in ("a", "", "b")]
    want = mixed(plain, requests)
    for _ in range(2):                                           # the second time over a warm prefix cache
        got = mixed(small, requests)
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)
    m = small.info()
    assert m["preemptions"] > 0 and m["resumed_rows"] == m["preemptions"] and m["prefix_hit_blocks"] > 0
    assert m["kv_blocks_used"] == 0 and sum(small._paged.pool.ref) == 0


def test_an_adapter_reloaded_mid_decode_keeps_its_rows_old_kv_out_of_the_cache(model_dir, adapters):
    """Partial rollouts (continue): an adapter's reload lands between two steps; its running rows go on over the old
    load's KV, which is never cached as the new load's, while the other adapter's rows' blocks are cached as usual."""
    plain, paged = engine(model_dir, paged=False), engine(model_dir, paged=True)
    paged._paged.sync_every = 1          # windows of one step: the reload lands right after the gated call's step
    for e in (plain, paged):
        load(e, adapters, "a")
        load(e, adapters, "b")
    prompt = [PROMPTS[1]]
    requests = [GenerateBatch(request(x, prompts=prompt, n=2, temperature=1.0, seed=2, max_tokens=24).prompts,
                              request(x, n=2, temperature=1.0, seed=2, max_tokens=24).sampling,
                              partial_rollout="continue") for x in ("a", "b")]
    epoch = paged._paged._epoch

    async def run():
        gate = Gate(paged.model.model.embed_tokens, (5, 10))     # model calls: 1 = the prefill, then one per step
        try:
            await paged._lock.acquire()              # both requests queue, then decode together
            gens = [asyncio.ensure_future(paged.generate(r)) for r in requests]
            await asyncio.sleep(0)
            paged._lock.release()
            await gate.wait(5)
            tensors, config = adapters["a2"]
            update = asyncio.ensure_future(paged.apply_adapter("a", 2, config, tensors))
            await asyncio.sleep(0)
            gate.open(5)
            await update                                          # landed at the next step boundary
            gate.open(10)
            return [await g for g in gens]
        finally:
            gate.handle.remove()

    got = asyncio.run(run())
    assert paged.stats["swaps_mid_generation"] == 1 and paged.stats["decode_batches"] == 1
    assert paged._paged._epoch == epoch                           # the base weights' KV tag did not move
    assert all(s.weight_versions is not None and s.weight_versions[-1] == 2 for g in got for s in samples(g))
    cached = cached_by_adapter(paged)
    assert "a" not in cached and cached["b"] > 0
    load(plain, adapters, "a2", as_name="a", version=2)
    for x, hit in (("a", 0), ("b", 8)):
        out = paged.generate_sync(request(x, prompts=prompt))
        assert samples(out)[0].cached_prompt_tokens == hit, x
        assert_same(out, plain.generate_sync(request(x, prompts=prompt)))


def test_an_adapters_seed_starts_its_own_hash_chain_and_keep_adapters_drops_only_stale_loads():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    a1, a2, b1 = ("a", 1, 1), ("a", 2, 2), ("b", 1, 3)
    chains = [chain_hashes(tokens, 4, adapter_seed(x)) for x in (None, a1, a2, b1)]
    assert chains[0] == chain_hashes(tokens, 4) and len({c[0] for c in chains}) == 4
    pool = BlockPool(8, 4)
    for x in (None, a1, b1):
        t = BlockTable()
        pool.reserve(t, 8)
        t.num_tokens = 8
        pool.register(tokens, t, 0, adapter=x)
        pool.free(t)
    assert pool.lookup(tokens, 0, adapter=a2).blocks == []               # a's next load finds nothing of a's first
    assert pool.lookup(tokens, 0, adapter=b1).num_tokens == 8
    assert pool.keep_adapters({a2, b1}) == 2 and pool.num_cached == 4    # a1's 2 blocks go; b's and the base's stay
    # a1's blocks are free again; b's and the base's are held by the two lookups
    assert pool.lookup(tokens, 0).num_tokens == 8 and pool.num_free == 4
