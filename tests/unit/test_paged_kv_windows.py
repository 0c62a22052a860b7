"""Windows of paged decode steps (services/rollout/engine_torch/paged/window.py): k steps with the tokens fed back on
the device and one host sync, then the bookkeeping of the k steps. A row that ends inside a window (eos, its budget,
a stop string) ends exactly where the one-step loop ends it and lets go of the blocks reserved past its end;
preemption happens at window boundaries; log-probs equal a full forward; the fused sampler's windows (Triton's CPU
interpreter) sample what the non-paged CUDA-graph decoder samples."""

from __future__ import annotations

import asyncio
import textwrap

import pytest
import torch

from services.common.tensors.modeling import response_logprobs
from services.rollout.config import RolloutSettings
from services.rollout.engine_torch.engine import TorchEngine, _Job
from services.rollout.engine_torch.paged.kv import block_bytes
from services.rollout.testing import Gate, make_tiny_model, random_state_like
from services.rollout.types import GenerateBatch, PromptInput, SamplingParams
from tests.interpreted import assert_printed_ok, run_interpreted

PROMPTS = [[4, 5, 13, 6, 15], [7, 3, 9, 12, 8, 10, 11, 14, 16, 4, 4, 5], [20]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("window_model"), max_position_embeddings=256)


def today(path: str) -> TorchEngine:
    return TorchEngine(RolloutSettings(model={"path": path}))


def paged(path: str, *, blocks: int | None = None, sync_every: int = 16, static: bool = False,
          **rollout) -> TorchEngine:
    if blocks is not None:
        rollout["kv_cache_gib"] = blocks * block_bytes(today(path).model, 4) / 2**30
    eng = TorchEngine(RolloutSettings(model={"path": path}, rollout=dict(kv_cache="paged", kv_block_size=4, **rollout)))
    eng._paged.sync_every = sync_every
    if static:             # the graph path's static padded step, uncaptured: ids/positions advanced on the device
        from services.rollout.engine_torch.paged.graphs import PagedGraphs
        dec = eng._paged
        dec.graphs = PagedGraphs(eng.model, dec.kv, width=256 // 4, scratch_block=dec.pool.allocate(),
                                 max_batch_size=eng.max_batch_size, use_graphs=False, kernel=False)
    return eng


def gen(engine, prompts=PROMPTS, **sampling):
    batch = GenerateBatch([PromptInput(id=f"p{i}", prompt_ids=list(p)) for i, p in enumerate(prompts)],
                          SamplingParams(**sampling))
    return [s for r in asyncio.run(engine.generate(batch)) for s in r.samples]


def assert_same(got, want):
    assert [(s.response_ids, s.finish_reason) for s in got] == [(s.response_ids, s.finish_reason) for s in want]
    for a, b in zip(got, want):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def windows_ran(eng) -> bool:
    st = eng._paged.stats
    return 0 < st["decode_syncs"] < st["decode_steps"]           # at least one window of several steps


@pytest.mark.parametrize("static", [False, True])
def test_an_eos_inside_a_window_ends_the_row_there_and_lets_go_of_the_blocks_past_it(model_dir, static):
    sampling = dict(n=3, temperature=1.0, seed=12, max_tokens=40)
    ref = gen(today(model_dir), **sampling)
    # A token the first sample draws first mid-window (index j of 16) becomes eos: rows end at its first draw.
    ids = ref[0].response_ids
    j = next(i for i in range(3, 15) if ids[i] not in ids[:i])
    eos = ids[j]
    base, eng = today(model_dir), paged(model_dir, static=static)
    base.eos_ids = eng.eos_ids = {eos}
    want, got = gen(base, **sampling), gen(eng, **sampling)
    assert_same(got, want)
    assert got[0].finish_reason == "stop" and len(got[0].response_ids) == j + 1
    assert windows_ran(eng)
    pool = eng._paged.pool
    assert eng.info()["kv_blocks_used"] == static and sum(pool.ref) == static       # nothing reserved is kept
    # What the ended rows left in the prefix cache is their own KV: a prompt of prompt + response reuses it and
    # decodes what a fresh engine decodes.
    follow = [PROMPTS[0] + got[0].response_ids[:-1]]
    again = gen(eng, prompts=follow, temperature=0.0, max_tokens=8)
    assert again[0].cached_prompt_tokens > 0
    assert_same(again, gen(base, prompts=follow, temperature=0.0, max_tokens=8))
    # An episode's turn that ends inside a window pins its table up to its end, not the blocks reserved past it.
    batch = GenerateBatch([PromptInput(id="e", prompt_ids=PROMPTS[0], episode_id="ep")],
                          SamplingParams(**{**sampling, "n": 1}))              # episodes are rows of n = 1
    turn = asyncio.run(eng.generate(batch))[0].samples[0]
    assert turn.response_ids == got[0].response_ids
    pinned = eng._paged.pins._pins["ep"].table
    assert pinned.num_tokens == len(PROMPTS[0]) + j and len(pinned.blocks) == -(-pinned.num_tokens // 4)


def test_rows_of_several_budgets_end_inside_windows_at_their_budget(model_dir):
    budgets = [3, 7, 16, 21]

    def jobs():
        return [_Job(GenerateBatch([PromptInput(id=f"p{i}", prompt_ids=p) for i, p in enumerate(PROMPTS)],
                                   SamplingParams(n=2, temperature=1.0, seed=30 + k, max_tokens=m)),
                     [list(p) for p in PROMPTS], None) for k, m in enumerate(budgets)]

    base, eng = today(model_dir), paged(model_dir, sync_every=8)
    base.eos_ids = eng.eos_ids = set()                    # every row runs to its budget
    want, got = base._generate_jobs(jobs()), eng._generate_jobs(jobs())
    for w, g, m in zip(want, got, budgets):
        samples = [s for r in g for s in r.samples]
        assert_same(samples, [s for r in w for s in r.samples])
        assert all(len(s.response_ids) == m and s.finish_reason == "length" for s in samples)
    assert windows_ran(eng) and eng.info()["kv_blocks_used"] == 0


def test_rows_ending_inside_a_window_run_on_into_the_chained_window_and_keep_their_own_samples(model_dir):
    """Windows of 8, each launched before the host reads the one before it (chained windows): rows of four budgets
    and an eos drawn mid-window end where today's engine ends them, though they run on into the window launched
    after theirs (its tokens dropped); top-logprobs stay each row's own as rows drop out of later windows; every
    block reserved past a row's end goes back."""
    budgets = [5, 11, 19, 30]

    def jobs():
        return [_Job(GenerateBatch([PromptInput(id=f"p{i}", prompt_ids=p) for i, p in enumerate(PROMPTS)],
                                   SamplingParams(n=2, temperature=1.0, seed=40 + k, max_tokens=m, top_logprobs=2)),
                     [list(p) for p in PROMPTS], None) for k, m in enumerate(budgets)]

    def samples(engine):
        return [s for job in engine._generate_jobs(jobs()) for r in job for s in r.samples]

    base, chained, unchained = today(model_dir), paged(model_dir, sync_every=8), paged(model_dir, sync_every=8)
    unchained._paged.chain_windows = False
    ids = samples(base)[-1].response_ids
    base.eos_ids = chained.eos_ids = unchained.eos_ids = {next(t for i, t in enumerate(ids) if i > 12
                                                               and t not in ids[:i])}
    want = samples(base)
    assert {s.finish_reason for s in want} == {"stop", "length"}
    for eng in (chained, unchained):
        got = samples(eng)
        assert_same(got, want)
        assert [[t for t, _ in step] for s in got for step in s.top_logprobs] == \
            [[t for t, _ in step] for s in want for step in s.top_logprobs]
        assert eng.info()["kv_blocks_used"] == 0
    assert chained._paged.stats["chained_windows"] > 0 and unchained._paged.stats["chained_windows"] == 0


def test_stop_strings_inside_a_window_cut_where_the_one_step_loop_cuts(model_dir):
    sampling = dict(n=2, temperature=1.0, seed=4, max_tokens=30)
    text = gen(today(model_dir), **sampling)[0].text
    stop = text[6:8]
    eng = paged(model_dir)
    a, b = gen(today(model_dir), stop=[stop], **sampling), gen(eng, stop=[stop], **sampling)
    assert [(s.text, s.finish_reason, s.response_ids) for s in a] == [(s.text, s.finish_reason, s.response_ids)
                                                                        for s in b]
    assert b[0].finish_reason == "stop" and 0 < len(b[0].response_ids) < 16 and windows_ran(eng)


@pytest.mark.parametrize("static", [False, True])
def test_a_pool_that_runs_dry_preempts_at_a_window_boundary_and_resumes_with_the_same_samples(model_dir, static):
    """8 rows of up to 11 blocks in 48: windows run while the rows are short, then the pool cannot hold them (k
    falls back to 1) and the latest rows are preempted between two windows and resume later."""
    prompts = [PROMPTS[0], PROMPTS[1]]
    sampling = dict(n=4, temperature=1.0, seed=5, max_tokens=32)
    base, eng = today(model_dir), paged(model_dir, blocks=48 + static, static=static)
    base.eos_ids = eng.eos_ids = set()                    # every row runs to its budget
    want, got = gen(base, prompts=prompts, **sampling), gen(eng, prompts=prompts, **sampling)
    assert_same(got, want)
    m = eng.info()
    assert m["preemptions"] > 0 and m["resumed_rows"] == m["preemptions"] and windows_ran(eng)
    assert m["kv_blocks_used"] == static


async def _swapped_turn(eng, gated_call: int, mode: str):
    """10 greedy tokens of one row (partial rollouts `mode`) with a weight update posted during model call
    `gated_call` (1 = the prefill, then one per step)."""
    gate = Gate(eng.model.model.embed_tokens, (gated_call,))
    try:
        batch = GenerateBatch([PromptInput(prompt_ids=PROMPTS[1])], SamplingParams(temperature=0.0, max_tokens=10),
                              partial_rollout=mode)
        gen = asyncio.ensure_future(eng.generate(batch))
        await gate.wait(gated_call)
        update = asyncio.ensure_future(eng.apply_update(1, random_state_like(eng.model, seed=4)))
        await asyncio.sleep(0)                       # the update posts its swap
        gate.open(gated_call)
        await update
        return (await gen)[0].samples[0]
    finally:
        gate.handle.remove()


@pytest.mark.parametrize("mode", ["continue", "pause"])
def test_a_weight_swap_posted_inside_a_window_lands_at_its_end_as_between_two_steps(model_dir, mode):
    """Windows of 4: the update posted during call 3 (feeding token 1) lands after the window's 4 tokens; the step
    that ran ahead with the old weights (token 3) is fed again by the new ones. The one-step loop with the update
    posted during call 4 (feeding token 2) lands at the same token: the same tokens and versions."""
    windowed, one_step = paged(model_dir, sync_every=4), paged(model_dir, sync_every=1)
    got = asyncio.run(_swapped_turn(windowed, 3, mode))
    want = asyncio.run(_swapped_turn(one_step, 4, mode))
    assert got.weight_versions == want.weight_versions == [0] * 4 + [1] * 6
    assert got.response_ids == want.response_ids
    assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0)
    assert windowed._paged.stats["decode_syncs"] < windowed._paged.stats["decode_steps"]


@pytest.mark.parametrize("static,sync_every", [(False, 16), (True, 5)])
def test_window_logprobs_equal_a_full_forward_of_prompt_and_response(model_dir, static, sync_every):
    eng = paged(model_dir, max_batch_size=4, static=static, sync_every=sync_every)
    eng.eos_ids = set()                                   # every row runs to its budget: windows past a row's end
    samples = gen(eng, n=3, temperature=1.0, seed=7, max_tokens=37)
    prompts = [p for p in PROMPTS for _ in range(3)]
    lp, _ = response_logprobs(eng.model, prompts, [s.response_ids for s in samples], pad_id=eng.pad_id)
    for i, s in enumerate(samples):
        assert len(s.response_ids) == 37
        assert torch.allclose(torch.tensor(s.logprobs), lp[i, :37], atol=1e-4, rtol=0), i
    assert windows_ran(eng)


@pytest.mark.slow
def test_fused_sampler_windows_sample_what_the_unpaged_graph_decoder_samples_in_the_interpreter(tmp_path):
    """The fused Triton sampler (each row's Philox stream keyed by its seed, counter = its token index) in paged
    windows, rows admitted four at a time, equals the non-paged CUDA-graph decoder's step (uncaptured) with the
    same sampler: seeded and greedy rows, on CPU tensors in Triton's interpreter."""
    pytest.importorskip("triton")
    model_dir = make_tiny_model(tmp_path / "m", max_position_embeddings=256)
    script = textwrap.dedent(f"""
        import asyncio
        from services.rollout.engine_torch import fused_sample
        fused_sample.available = lambda device: True          # CPU tensors, run by the interpreter
        from services.rollout.config import RolloutSettings
        from services.rollout.engine_torch.cuda_decode import GraphDecoder
        from services.rollout.engine_torch.engine import TorchEngine
        from services.rollout.types import GenerateBatch, PromptInput, SamplingParams
        path, prompts = {model_dir!r}, {PROMPTS!r}
        def gen(e, **sp):
            b = GenerateBatch([PromptInput(id=str(i), prompt_ids=p) for i, p in enumerate(prompts)],
                              SamplingParams(**sp))
            return [s for r in asyncio.run(e.generate(b)) for s in r.samples]
        paged = TorchEngine(RolloutSettings(model={{"path": path}}, rollout=dict(kv_cache="paged", kv_block_size=4,
                                                                                 max_batch_size=4)))
        # 9 rows at most: the seeded case's 9 rows run unpadded (a bucket of 16 took 1.6x their time in the
        # interpreter), the greedy case's 6 are padded to 8 with dummy rows.
        plain = TorchEngine(RolloutSettings(model={{"path": path}}, rollout=dict(max_batch_size=9)))
        plain._graph_decoder = GraphDecoder(plain.model, pad_id=plain.pad_id, eos_ids=sorted(plain.eos_ids),
                                            max_batch_size=9, use_graphs=False, compile=False, fused_sampler=True,
                                            triton_attention=False)
        for sp in (dict(n=3, temperature=1.0, seed=11, max_tokens=20), dict(n=2, temperature=0.0, max_tokens=20)):
            a, b = gen(paged, **sp), gen(plain, **sp)
            assert [s.response_ids for s in a] == [s.response_ids for s in b], sp
            assert max(abs(u - v) for x, y in zip(a, b) for u, v in zip(x.logprobs, y.logprobs)) < 1e-4
        st = paged._paged.stats
        assert paged._paged.sampler.fused and st["decode_steps"] >= 2 * st["decode_syncs"], st
        print("ok")
    """)
    assert_printed_ok(run_interpreted(script, timeout=900))
