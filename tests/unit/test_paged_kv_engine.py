"""The torch engine with rollout.kv_cache: paged (services/rollout/engine_torch/paged/): the same tokens and log-probs
as today's decode and as a full forward, a GRPO group's prompt prefilled once, prefixes reused across calls and
episode turns, preemption and resume under a small budget, weight versions, and the settings' refusals."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.common.tensors.modeling import response_logprobs
from services.rollout.config import RolloutSettings
from services.rollout.engine_torch.engine import TorchEngine
from services.rollout.engine_torch.paged.forward import paged_forward
from services.rollout.engine_torch.paged.kv import block_bytes
from services.rollout.testing import make_tiny_model, random_state_like
from services.rollout.types import GenerateBatch, PromptInput, SamplingParams

PROMPTS = [[4, 5, 13, 6, 15], [7, 3, 9, 12, 8, 10, 11, 14, 16, 4, 4, 5], [20]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("paged_model"))


def make_engine(path: str, **rollout) -> TorchEngine:
    return TorchEngine(RolloutSettings(model={"path": path}, rollout=rollout))


def paged(path: str, **rollout) -> TorchEngine:
    return make_engine(path, kv_cache="paged", kv_block_size=4, **rollout)


def gen(engine, prompts=PROMPTS, **sampling):
    batch = GenerateBatch([PromptInput(id=f"p{i}", prompt_ids=list(p)) for i, p in enumerate(prompts)],
                          SamplingParams(**sampling))
    return asyncio.run(engine.generate(batch))


def flat(results):
    return [s for r in results for s in r.samples]


def blocks_gib(engine, n: int) -> float:
    return n * block_bytes(engine.model, 4) / 2**30


@pytest.mark.parametrize("sampling", [dict(n=3, temperature=1.0, seed=11), dict(n=2, temperature=0.7, top_p=0.8, seed=3),
                                      dict(n=2, temperature=0.0, top_logprobs=3)])
def test_paged_decode_samples_what_todays_decode_samples_with_the_same_logprobs(model_dir, sampling):
    today, new = make_engine(model_dir), paged(model_dir)
    a, b = flat(gen(today, max_tokens=20, **sampling)), flat(gen(new, max_tokens=20, **sampling))
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert [s.finish_reason for s in a] == [s.finish_reason for s in b]
    for x, y in zip(a, b):
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)
        if sampling.get("top_logprobs"):
            assert [[t for t, _ in step] for step in x.top_logprobs] == [[t for t, _ in step] for step in y.top_logprobs]


def test_paged_logprobs_equal_a_full_forward_of_prompt_and_response(model_dir):
    eng = paged(model_dir, max_batch_size=4)
    results = gen(eng, max_tokens=24, n=3, temperature=1.0, seed=7)
    prompts = [r.prompt_ids for r in results for _ in r.samples]
    samples = flat(results)
    lp, _ = response_logprobs(eng.model, prompts, [s.response_ids for s in samples], pad_id=eng.pad_id)
    for i, s in enumerate(samples):
        assert torch.allclose(torch.tensor(s.logprobs), lp[i, :len(s.response_ids)], atol=1e-4, rtol=0), i


def test_a_ragged_paged_forward_equals_the_models_own_logits(model_dir):
    eng = paged(model_dir)
    dec = eng._paged
    seqs = [[3, 4, 5, 6, 7, 8, 9], [10, 11, 17, 18], [12, 13, 14, 15, 16]]
    tables = []
    for q in seqs:
        from services.rollout.engine_torch.paged.blocks import BlockTable
        t = BlockTable()
        dec.pool.reserve(t, len(q))
        tables.append(t.blocks)
    own = lambda q: eng.model(input_ids=torch.tensor([q])).logits[0, -1].float()  # noqa: E731
    # Fed in pieces as later calls would: fresh prompts (causal over the forward's own K/V), then two tokens after a
    # cached prefix (the masked attention over gathered slots), then one.
    first = paged_forward(eng.model, dec.kv, tables, [0] * 3, [q[:-3] for q in seqs])
    mid = paged_forward(eng.model, dec.kv, tables, [len(q) - 3 for q in seqs], [q[-3:-1] for q in seqs])
    got = paged_forward(eng.model, dec.kv, tables, [len(q) - 1 for q in seqs], [q[-1:] for q in seqs])
    for q, a, b, c in zip(seqs, first, mid, got):
        for lg, upto in ((a, len(q) - 3), (b, len(q) - 1), (c, len(q))):
            assert torch.allclose(lg, own(q[:upto]), atol=1e-4, rtol=0)


def test_a_group_prefills_its_prompt_once_and_forks_it(model_dir):
    eng = paged(model_dir)
    prompt = PROMPTS[1][:10]                                    # 2 full blocks of 4 and one of 2 tokens
    out = flat(gen(eng, prompts=[prompt], n=8, temperature=1.0, seed=1, max_tokens=6))
    assert [s.cached_prompt_tokens for s in out] == [0] + [10] * 7
    m = eng.info()
    samples = flat(gen(make_engine(model_dir), prompts=[prompt], n=2, max_tokens=2))
    assert [s.cached_prompt_tokens for s in samples] == [0, 0]      # today's cache reuses nothing it reports
    assert m["prefill_tokens"] == len(prompt)                   # one prefill for 8 samples
    assert m["prefill_tokens_saved"] == 7 * len(prompt)
    assert m["cow_copies"] == 7                                 # the shared partial block, copied by 7 of 8
    assert m["kv_blocks_used"] == 0                              # every row let go; its full blocks stay cached
    assert m["kv_blocks_cached"] > 0


def test_a_later_call_and_an_episodes_next_turn_feed_only_their_new_tokens(model_dir):
    eng = paged(model_dir)
    first = flat(gen(eng, prompts=[PROMPTS[1]], n=1, temperature=0.0, max_tokens=9))[0]
    fed = eng.info()["prefill_tokens"]
    history = PROMPTS[1] + first.response_ids + [21, 22, 23]      # the tool's answer appended
    turn = flat(gen(eng, prompts=[history], n=1, temperature=0.0, max_tokens=4))[0]
    m = eng.info()
    assert turn.cached_prompt_tokens == 4 * m["prefix_hit_blocks"]
    new_tokens = m["prefill_tokens"] - fed
    assert new_tokens < 4 + 3                        # the tool tokens and at most one block's tail, not the history
    assert m["prefix_hit_blocks"] == (len(PROMPTS[1]) + len(first.response_ids)) // 4
    today = flat(gen(make_engine(model_dir), prompts=[history], n=1, temperature=0.0, max_tokens=4))[0]
    again = flat(gen(eng, prompts=[history], n=1, temperature=0.0, max_tokens=4))[0]
    assert again.response_ids == today.response_ids
    assert torch.allclose(torch.tensor(again.logprobs), torch.tensor(today.logprobs), atol=1e-5, rtol=0)


def test_a_full_pool_preempts_rows_which_resume_with_the_same_samples(model_dir):
    probe = paged(model_dir)
    small = paged(model_dir, kv_cache_gib=blocks_gib(probe, 14))     # 8 rows of up to 7 blocks do not fit
    prompts = [PROMPTS[0], PROMPTS[1]]
    sampling = dict(n=4, temperature=1.0, seed=5, max_tokens=16)
    want = flat(gen(make_engine(model_dir), prompts=prompts, **sampling))
    got = flat(gen(small, prompts=prompts, **sampling))
    m = small.info()
    assert m["preemptions"] > 0 and m["resumed_rows"] == m["preemptions"]
    assert [s.response_ids for s in got] == [s.response_ids for s in want]
    for x, y in zip(got, want):
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)
    assert m["kv_blocks_used"] == 0


def test_a_prompt_larger_than_the_whole_budget_is_refused_by_name(model_dir):
    probe = paged(model_dir)
    tiny = paged(model_dir, kv_cache_gib=blocks_gib(probe, 2))
    with pytest.raises(ValueError, match="rollout.kv_cache_gib"):
        gen(tiny, prompts=[PROMPTS[1]], n=1, max_tokens=4)
    assert tiny.info()["kv_blocks_used"] == 0


def test_new_weights_drop_the_cached_blocks_of_the_old_ones(model_dir):
    eng = paged(model_dir)
    gen(eng, prompts=[PROMPTS[1]], n=2, temperature=0.0, max_tokens=8)
    assert eng.info()["kv_blocks_cached"] > 0
    asyncio.run(eng.apply_update(1, random_state_like(eng.model, seed=3)))
    fed = eng.info()["prefill_tokens"]
    out = flat(gen(eng, prompts=[PROMPTS[1]], n=1, temperature=0.0, max_tokens=8))[0]
    m = eng.info()
    assert m["invalidated_blocks"] > 0 and m["prefill_tokens"] - fed == len(PROMPTS[1])
    assert out.weight_version == 1
    lp, _ = response_logprobs(eng.model, [PROMPTS[1]], [out.response_ids], pad_id=eng.pad_id)
    assert torch.allclose(torch.tensor(out.logprobs), lp[0, :len(out.response_ids)], atol=1e-4, rtol=0)


def test_stop_strings_cut_paged_samples_as_they_cut_todays(model_dir):
    today, new = make_engine(model_dir), paged(model_dir)
    sampling = dict(n=2, temperature=1.0, seed=4, max_tokens=20)
    text = flat(gen(today, **sampling))[0].text
    stop = text[3:5] if len(text) >= 5 else text[-1:]
    a, b = flat(gen(today, stop=[stop], **sampling)), flat(gen(new, stop=[stop], **sampling))
    assert [(s.text, s.finish_reason, s.response_ids) for s in a] == [(s.text, s.finish_reason, s.response_ids)
                                                                        for s in b]
    assert any(s.finish_reason == "stop" for s in b)


def test_kv_cache_auto_keeps_todays_cache_on_cpu_and_paged_needs_the_torch_engine(model_dir):
    assert make_engine(model_dir)._paged is None
    with pytest.raises(ValueError, match="kv_cache: paged needs engine 'torch'"):
        RolloutSettings(model={"path": model_dir}, rollout={"engine": "vllm", "kv_cache": "paged"})


def test_prometheus_reports_the_live_decoders_kv_metrics(model_dir):
    from prometheus_client import REGISTRY, generate_latest

    eng = paged(model_dir)
    gen(eng, prompts=[PROMPTS[1][:10]], n=4, temperature=1.0, seed=2, max_tokens=4)
    text = generate_latest(REGISTRY).decode()
    assert "meshrl_rollout_kv_blocks_total" in text and "meshrl_rollout_prefill_tokens_saved_total" in text
    assert REGISTRY.get_sample_value("meshrl_rollout_prefill_tokens_saved_total") >= 3 * 10


@pytest.mark.parametrize("seed,static", [(0, False), (1, False), (2, False), (3, True), (4, True)])
def test_random_mixes_under_a_tight_budget_match_todays_decode_and_leak_no_block(model_dir, seed, static):
    """Prompts of random lengths (some repeated: groups across requests), several requests of different budgets
    decoded together, a pool of 24 blocks of 4 tokens: preemptions, forks, evictions all happen; every sample and
    log-prob is today's, and every block is back (free or cached, none held) afterwards."""
    from services.rollout.engine_torch.engine import _Job

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 33, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
               for _ in range(6)]
    prompts += prompts[:2]
    jobs = lambda: [_Job(GenerateBatch([PromptInput(id=f"p{i}", prompt_ids=p) for i, p in enumerate(prompts[k::3])],  # noqa: E731
                                       SamplingParams(n=1 + k, temperature=1.0, seed=seed * 10 + k, max_tokens=4 + 9 * k)),
                         [list(p) for p in prompts[k::3]], None) for k in range(3)]
    probe = paged(model_dir)
    small = paged(model_dir, kv_cache_gib=blocks_gib(probe, 24 + static))
    if static:           # the graph path's static padded step (uncaptured): buckets change as rows end and resume
        from services.rollout.engine_torch.paged.graphs import PagedGraphs
        # As wide as the decoder makes it: the longest row (under 128 tokens here) plus a window of steps.
        small._paged.graphs = PagedGraphs(small.model, small._paged.kv, width=-(-(128 + small._paged.sync_every) // 4),
                                          scratch_block=small._paged.pool.allocate(), max_batch_size=64,
                                          use_graphs=False, kernel=False)
    want = make_engine(model_dir)._generate_jobs(jobs())
    for _ in range(2):                       # the second time over a warm prefix cache
        got = small._generate_jobs(jobs())
        for a, b in zip(flat([r for res in want for r in res]), flat([r for res in got for r in res])):
            assert a.response_ids == b.response_ids and a.finish_reason == b.finish_reason
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    pool = small._paged.pool
    m = small.info()
    assert m["preemptions"] > 0 and m["cow_copies"] > 0 and m["prefix_hit_blocks"] > 0
    assert sum(pool.ref) == static and m["kv_blocks_free"] == 24 and m["kv_blocks_total"] == 24 + static


@pytest.mark.parametrize("columnar", [False, True])
def test_cached_prompt_tokens_travel_in_the_answer_and_make_a_step_metric(columnar):
    import numpy as np

    from coordinator.training.remote import Problem, Sample
    from coordinator.training.reporting import sample_metrics
    from services.rollout.convert import results_from_pb, results_to_pb
    from services.rollout.types import PromptResult, SampleResult

    results = [PromptResult("p0", [1, 2, 3, 4], [SampleResult([5], [-0.5], "a", "stop", 0),
                                                 SampleResult([6], [-0.7], "b", "stop", 0, cached_prompt_tokens=4)])]
    back = results_from_pb(results_to_pb(results, columnar=columnar))
    assert [s.cached_prompt_tokens for s in back[0].samples] == [0, 4]
    problem = Problem(id="q", prompt="p", ground_truth="1", data_source="arith")
    samples = [Sample(problem, 0, np.array([1, 2, 3, 4], dtype=np.int32), np.array([5], dtype=np.int32),
                      np.array([-0.5], dtype=np.float32), "", "stop", 0, cached_prompt_tokens=c) for c in (0, 4)]
    assert sample_metrics(samples)["rollout/prompt_tokens_cached_frac"] == 0.5
    assert "rollout/prompt_tokens_cached_frac" not in sample_metrics(samples[:1])


def test_the_budget_sets_the_pool_size_and_cpu_auto_stays_under_a_tenth_of_ram(model_dir, monkeypatch):
    import os

    from services.rollout.engine_torch.paged import kv

    eng = paged(model_dir)
    per = block_bytes(eng.model, 4)
    assert kv.num_blocks_for(eng.model, block_size=4, budget_gib=10 * per / 2**30, max_model_len=64)[0] == 10
    assert kv.num_blocks_for(eng.model, block_size=4, budget_gib=None, max_model_len=64)[0] == 256 * 16
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    n, why = kv.num_blocks_for(eng.model, block_size=4, budget_gib=None, max_model_len=1 << 40)
    assert n * per <= 0.1 * ram and "RAM" in why
    with pytest.raises(ValueError, match="rollout.kv_cache_gib"):
        kv.num_blocks_for(eng.model, block_size=4, budget_gib=per / 2 / 2**30, max_model_len=64)


async def _three_turns(ctx, prompt, sampling):
    """Three model turns with a fixed observation between them (the episode loop, without a tool)."""
    rec = ctx.recorder(ctx.prompt_ids(prompt))
    for turn in range(3):
        rec.add_sampled(await ctx.generate(rec.context_ids, max_tokens=6))
        if turn < 2:
            rec.add_observation([21, 22, 23])
    return rec.finish("max_turns", ctx.tokenizer)


def test_multi_turn_episodes_are_todays_and_each_turn_feeds_only_its_new_tokens(model_dir, monkeypatch):
    from services.rollout.agents import episodes
    from services.rollout.agents.episodes import EpisodeRunner
    from services.rollout.config import AgentConfig
    from services.rollout.types import EpisodePrompt

    monkeypatch.setitem(episodes.AGENT_LOOPS, "paged_three_turns", _three_turns)
    prompts = [EpisodePrompt(id=f"q{i}", prompt_ids=p, agent_name="paged_three_turns") for i, p in enumerate(PROMPTS)]

    def play(engine):
        runner = EpisodeRunner(engine, None, AgentConfig(name="single_turn"), max_tokens=6)
        groups = asyncio.run(runner.run(prompts, SamplingParams(n=2, temperature=1.0, seed=8, max_tokens=6),
                                        runner.defaults))
        return [e for g in groups for e in g.episodes]

    today = play(make_engine(model_dir))
    eng = paged(model_dir)
    got = play(eng)
    assert [e.response_ids for e in got] == [e.response_ids for e in today]
    for a, b in zip(got, today):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    m = eng.info()
    # Every turn's context (prompt + history) would be prefilled in full without the cache.
    contexts = sum(3 * len(p) for p in PROMPTS) * 2 + sum(len(e.response_ids) for e in got) * 2
    assert m["prefill_tokens"] < contexts / 3 and m["prefill_tokens_saved"] > m["prefill_tokens"]


def test_the_static_padded_decode_step_of_the_graph_path_decodes_as_the_eager_one(model_dir):
    """paged/graphs.py without capture (CPU): rows padded to the bucket with dummy rows on a scratch block, inputs
    copied into static buffers; the samples are the eager paged step's and the scratch block never leaks."""
    from services.rollout.engine_torch.paged.graphs import PagedGraphs

    want = flat(gen(paged(model_dir), n=3, temperature=1.0, seed=6, max_tokens=20))
    eng = paged(model_dir, kv_cache_gib=blocks_gib(paged(model_dir), 40))
    dec = eng._paged
    dec.graphs = PagedGraphs(eng.model, dec.kv, width=64 // 4, scratch_block=dec.pool.allocate(),
                             max_batch_size=eng.max_batch_size, use_graphs=False, kernel=False)
    got = flat(gen(eng, n=3, temperature=1.0, seed=6, max_tokens=20))
    assert [s.response_ids for s in got] == [s.response_ids for s in want]
    for a, b in zip(got, want):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    assert eng.info()["kv_blocks_used"] == 1 and dec.graphs.scratch not in dec.pool._free


def test_paged_cuda_graphs_auto_resolves_off_on_cpu_and_says_why(model_dir):
    eng = paged(model_dir)
    choice = eng.resolved.choices["rollout.kv_cache_cuda_graphs"]
    assert (choice.value, choice.asked, choice.why) == (False, "auto", "model.device is 'cpu', not CUDA")
    assert eng._paged.graphs is None


def test_paged_cuda_graphs_are_refused_without_paged_or_without_cuda(model_dir):
    with pytest.raises(ValueError, match="kv_cache_cuda_graphs: true needs kv_cache: paged"):
        RolloutSettings(model={"path": model_dir}, rollout={"kv_cache_cuda_graphs": True})
    with pytest.raises(ValueError, match=r"rollout.kv_cache_cuda_graphs: true cannot work here \(model.device is 'cpu', "
                                         r"not CUDA\)"):
        paged(model_dir, kv_cache_cuda_graphs=True)


def test_the_paged_warm_up_decodes_then_leaves_no_cached_blocks_and_counts_from_zero(model_dir):
    """speed.warm_up_paged (the replica's warm-up with the paged cache's CUDA graphs; run here on its eager steps):
    its decodes happen, then what they cached goes and the counters start from zero, so the run's first call
    finds an empty cache and its metrics count its own work."""
    from services.rollout.engine_torch.speed import warm_up_paged

    eng = paged(model_dir)
    before = eng._paged.stats["decode_steps"]
    seconds = warm_up_paged(eng._paged, 6, eng.max_model_len, eng.pad_id, eng.vocab_size, eng.max_batch_size,
                            eng.weight_version)
    assert seconds > 0 and before == 0
    m = eng._paged.metrics()
    assert m["kv_blocks_cached"] == 0 and m["kv_blocks_used"] == 0
    assert m["decode_steps"] == m["prefill_tokens"] == m["prefix_lookup_blocks"] == 0
    out = flat(gen(eng, prompts=[PROMPTS[0]], n=2, temperature=0.0, max_tokens=4))
    assert [s.response_ids for s in out] == [s.response_ids for s in flat(gen(make_engine(model_dir), prompts=[PROMPTS[0]],
                                                                               n=2, temperature=0.0, max_tokens=4))]
    assert eng._paged.stats["prefill_tokens"] == len(PROMPTS[0])
