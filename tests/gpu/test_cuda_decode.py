"""GPU tests of the rollout engine's CUDA-graph decode (services/rollout/engine_torch/cuda_decode.py); skipped without
CUDA."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.common.tensors.modeling import response_logprobs
from services.common.tensors.weights import build_manifest, iter_buckets
from services.rollout.config import RolloutSettings
from services.rollout.engine_torch.engine import TorchEngine
from services.rollout.testing import make_tiny_model, random_state_like
from services.rollout.types import GenerateBatch, PromptInput, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[4, 5, 13, 6, 15], [7, 3, 9, 12, 8, 10, 11, 14, 16, 4, 4, 5], [20]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("cuda_decode_model"), max_position_embeddings=512)


def make_engine(path: str, *, graphs: bool, dtype: str = "float32", compile: bool = False, **rollout) -> TorchEngine:
    # Most tests decode eagerly-built graphs; compiling costs seconds per bucket (one test compiles).
    return TorchEngine(RolloutSettings(model={"path": path, "device": "cuda", "dtype": dtype},
                                       rollout={"cuda_graphs": graphs, "cuda_graph_compile": compile,
                                                "kv_cache": "none", **rollout}))


@pytest.fixture(scope="module")
def graph_engine(model_dir) -> TorchEngine:
    return make_engine(model_dir, graphs=True, max_batch_size=16)


@pytest.fixture(scope="module")
def eager_engine(model_dir) -> TorchEngine:
    return make_engine(model_dir, graphs=False, max_batch_size=16)


def gen(engine, prompts=PROMPTS, **sampling):
    batch = GenerateBatch([PromptInput(id=f"p{i}", prompt_ids=list(p)) for i, p in enumerate(prompts)],
                          SamplingParams(**sampling))
    return asyncio.run(engine.generate(batch))


def flat(results):
    return [s for r in results for s in r.samples]


def _aiter(items):
    async def gen_():
        for x in items:
            yield x
    return gen_()


def test_greedy_graph_decode_gives_the_eager_loops_tokens_and_logprobs(graph_engine, eager_engine):
    a = flat(gen(graph_engine, n=2, temperature=0, max_tokens=40))
    b = flat(gen(eager_engine, n=2, temperature=0, max_tokens=40))
    assert graph_engine._graph_decoder.stats["replays"] > 0
    for x, y in zip(a, b):
        assert x.response_ids == y.response_ids
        assert x.finish_reason == y.finish_reason
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-4


@pytest.mark.parametrize("sampling", [dict(n=4, temperature=1.0), dict(n=3, temperature=0.7, top_p=0.8),
                                      dict(n=2, temperature=1.3, top_p=0.5)])
def test_sampled_logprobs_equal_a_full_forward_pass(graph_engine, sampling):
    results = gen(graph_engine, max_tokens=48, **sampling)
    prompts = [r.prompt_ids for r in results for _ in r.samples]
    samples = flat(results)
    lp, _ = response_logprobs(graph_engine.model, prompts, [s.response_ids for s in samples], pad_id=0)
    for i, s in enumerate(samples):
        assert len(s.logprobs) == len(s.response_ids) >= 1
        assert torch.allclose(torch.tensor(s.logprobs), lp[i, :len(s.logprobs)].cpu(), atol=1e-4, rtol=0), i


def test_eos_ends_a_row_with_stop_and_only_at_its_end(model_dir):
    eng = make_engine(make_tiny_model(model_dir + "_eos", eos_logit_zero=False, init_scale=1.0,
                                      max_position_embeddings=512), graphs=True)
    samples = flat(gen(eng, n=16, temperature=1.0, max_tokens=200))
    eos = 2
    assert any(s.finish_reason == "stop" for s in samples)
    for s in samples:
        assert eos not in s.response_ids[:-1]
        assert (s.finish_reason == "stop") == (s.response_ids[-1] == eos)
        assert s.finish_reason == "stop" or len(s.response_ids) == 200


def test_rows_finish_at_their_own_budget_near_max_model_len(model_dir):
    eng = make_engine(model_dir, graphs=True, max_model_len=20)
    samples = flat(gen(eng, temperature=0, max_tokens=100))
    assert [len(s.response_ids) for s in samples] == [20 - len(p) for p in PROMPTS]


def test_sampling_follows_the_tempered_distribution(model_dir):
    """The in-graph Gumbel race draws from softmax(logits / T): first-token frequencies against the model's."""
    eng = make_engine(make_tiny_model(model_dir + "_flat", init_scale=1.0, max_position_embeddings=512),
                      graphs=True, max_batch_size=1024)
    prompt, T, n = [4, 5, 6], 0.8, 1024
    counts = torch.zeros(eng.vocab_size)
    for _ in range(4):
        for s in flat(gen(eng, prompts=[prompt], n=n, temperature=T, max_tokens=1)):
            counts[s.response_ids[0]] += 1
    with torch.no_grad():
        logits = eng.model(input_ids=torch.tensor([prompt], device="cuda")).logits[0, -1].float().cpu()
    expected = torch.softmax(logits / T, -1)
    assert (counts / counts.sum() - expected).abs().max() < 0.03


def test_graphs_are_captured_once_and_survive_a_weight_update(model_dir):
    eng = make_engine(model_dir, graphs=True)
    eager = make_engine(model_dir, graphs=False)
    gen(eng, temperature=0, max_tokens=10)
    captured = eng._graph_decoder.stats["graphs_captured"]
    gen(eng, temperature=0, max_tokens=12)
    assert eng._graph_decoder.stats["graphs_captured"] == captured
    new = random_state_like(eng.model, seed=3)
    for e in (eng, eager):
        asyncio.run(e.update_weights(build_manifest(new, 1), _aiter(iter_buckets(new, 4096))))
    a, b = flat(gen(eng, temperature=0, max_tokens=30)), flat(gen(eager, temperature=0, max_tokens=30))
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert eng._graph_decoder.stats["graphs_captured"] == captured


def test_seeded_top_p_requests_use_the_eager_loop(graph_engine, eager_engine):
    before = graph_engine._graph_decoder.stats["replays"]
    a = flat(gen(graph_engine, n=2, temperature=1.0, top_p=0.9, max_tokens=16, seed=7))
    b = flat(gen(eager_engine, n=2, temperature=1.0, top_p=0.9, max_tokens=16, seed=7))
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert graph_engine._graph_decoder.stats["replays"] == before


@pytest.mark.parametrize("compile", [False, True])
def test_bf16_sampled_logprobs_stay_close_to_a_full_forward_pass(model_dir, compile):
    eng = make_engine(model_dir, graphs=True, dtype="bfloat16", compile=compile)
    results = gen(eng, n=4, temperature=1.0, max_tokens=64)
    prompts = [r.prompt_ids for r in results for _ in r.samples]
    samples = flat(results)
    lp, _ = response_logprobs(eng.model, prompts, [s.response_ids for s in samples], pad_id=0)
    worst = max(float((torch.tensor(s.logprobs) - lp[i, :len(s.logprobs)].float().cpu()).abs().max())
                for i, s in enumerate(samples))
    assert worst < 0.1, worst


def test_compiled_graph_decode_gives_the_eager_loops_greedy_tokens(model_dir, eager_engine):
    eng = make_engine(model_dir, graphs=True, compile=True, max_batch_size=16)
    a = flat(gen(eng, n=2, temperature=0, max_tokens=40))
    b = flat(gen(eager_engine, n=2, temperature=0, max_tokens=40))
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert max(abs(p - q) for x, y in zip(a, b) for p, q in zip(x.logprobs, y.logprobs)) < 1e-4


def test_weights_swapped_by_reference_are_recaptured(model_dir):
    eng = make_engine(model_dir, graphs=True)
    eager = make_engine(model_dir, graphs=False)
    gen(eng, temperature=0, max_tokens=10)
    captured = eng._graph_decoder.stats["graphs_captured"]
    new = random_state_like(eng.model, seed=5)
    with torch.no_grad():
        for e in (eng, eager):
            for name, p in e.model.named_parameters():
                if name in new:
                    p.data = new[name].to(p.device, p.dtype)        # new storage, old address gone
    a, b = flat(gen(eng, temperature=0, max_tokens=30)), flat(gen(eager, temperature=0, max_tokens=30))
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert eng._graph_decoder.stats["graphs_captured"] > captured


# ---- the Triton kernels of the decode step (services/rollout/engine_torch/fused_sample.py, decode_attention.py)


def test_fused_sampler_draws_from_softmax_over_temperature_and_records_the_raw_logprob():
    from services.rollout.engine_torch import fused_sample

    n, V = 20000, 11
    z = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5, 3.0, -5.0, 1.5, 2.5, 0.2, -0.3], device="cuda")
    logits = z.to(torch.bfloat16).repeat(n, 1)
    temp = torch.full((n,), 0.8, device="cuda")
    temp[:100] = 0.0                                                     # greedy rows
    seed, step = 7 + torch.arange(n, device="cuda"), torch.tensor([0], device="cuda")     # a key per row
    tok, lp = torch.empty(n, dtype=torch.long, device="cuda"), torch.empty(n, device="cuda")
    fused_sample.sample(logits, temp, seed, step, tok, lp)
    zf = logits[0].float()
    assert (tok[:100] == zf.argmax()).all()
    assert torch.allclose(lp, (zf - torch.logsumexp(zf, 0))[tok], atol=1e-6)
    freq = torch.bincount(tok[100:], minlength=V).float() / (n - 100)
    p = torch.softmax(zf / 0.8, 0)
    assert (freq - p).abs().max() < 5 * (p * (1 - p) / (n - 100)).sqrt().max()
    first = tok.clone()
    step.add_(1)                                                         # the next step draws afresh
    fused_sample.sample(logits, temp, seed, step, tok, lp)
    assert (tok[100:] != first[100:]).float().mean() > 0.3


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_triton_decode_attention_matches_masked_softmax_attention(dtype, atol):
    from services.rollout.engine_torch.decode_attention import decode_attention

    torch.manual_seed(0)
    B, H, KV, S, hd = 5, 14, 2, 320, 64
    q = torch.randn(B, H, hd, device="cuda").to(dtype)
    kc, vc = (torch.randn(B, KV, S, hd, device="cuda").to(dtype) for _ in range(2))
    pad = torch.tensor([0, 3, 64, 130, 200], device="cuda")
    slot = torch.tensor([200], device="cuda")
    out = decode_attention(q, kc, vc, pad, slot, hd ** -0.5)
    valid = (torch.arange(S, device="cuda") >= pad[:, None]) & (torch.arange(S, device="cuda") <= slot)
    sc = torch.einsum("bkgd,bksd->bkgs", q.float().view(B, KV, H // KV, hd), kc.float()) * hd ** -0.5
    ref = torch.einsum("bkgs,bksd->bkgd", sc.masked_fill(~valid[:, None, None], float("-inf")).softmax(-1),
                       vc.float()).reshape(B, H, hd)
    assert (out.float() - ref).abs().max() < atol


@pytest.mark.parametrize("kernels", [dict(cuda_graph_fused_sampler=False, cuda_graph_triton_attention=False),
                                     dict(cuda_graph_fused_sampler=True, cuda_graph_triton_attention=False)])
def test_graph_decode_with_torch_kernels_gives_the_same_greedy_tokens(model_dir, graph_engine, kernels):
    e = make_engine(model_dir, graphs=True, max_batch_size=16, **kernels)
    dec = e._graph_decoder
    assert dec.fused_sampler == kernels["cuda_graph_fused_sampler"] and not dec.triton_attention
    assert graph_engine._graph_decoder.fused_sampler and graph_engine._graph_decoder.triton_attention
    a = flat(gen(e, n=2, temperature=0, max_tokens=40))
    b = flat(gen(graph_engine, n=2, temperature=0, max_tokens=40))
    for x, y in zip(a, b):
        assert x.response_ids == y.response_ids
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-4


# ---- every sampling option on the graph path: seeds, stop strings, top-logprobs


def test_seeded_graph_decode_equals_the_eager_step_and_does_not_depend_on_the_batch(model_dir, graph_engine):
    from services.rollout.engine_torch.cuda_decode import GraphDecoder

    dec = graph_engine._graph_decoder
    eager = GraphDecoder(graph_engine.model, pad_id=graph_engine.pad_id, eos_ids=sorted(graph_engine.eos_ids),
                         max_batch_size=16, use_graphs=False, compile=False)
    prompts, seeds = [PROMPTS[0], PROMPTS[1], PROMPTS[0]], [11, 12, 13]
    kw = dict(seeds=seeds)
    a = dec.decode(prompts, [30] * 3, [1.0] * 3, [1.0] * 3, **kw)
    b = eager.decode(prompts, [30] * 3, [1.0] * 3, [1.0] * 3, **kw)
    assert a.tokens == b.tokens                                  # the captured step draws what the eager one does
    alone = dec.decode([PROMPTS[1]], [30], [1.0], [1.0], seeds=[12])
    assert alone.tokens[0] == a.tokens[1]                        # a seeded row's draw is its own
    assert a.tokens[0] != a.tokens[2]                            # same prompt, other seed: another sample


def test_seeded_requests_take_the_graph_path_and_repeat_exactly(graph_engine):
    before = graph_engine._graph_decoder.stats["replays"]
    a = flat(gen(graph_engine, n=4, temperature=1.0, max_tokens=24, seed=5))
    b = flat(gen(graph_engine, n=4, temperature=1.0, max_tokens=24, seed=5))
    c = flat(gen(graph_engine, n=4, temperature=1.0, max_tokens=24, seed=6))
    assert graph_engine._graph_decoder.stats["replays"] > before
    assert [s.response_ids for s in a] == [s.response_ids for s in b] != [s.response_ids for s in c]


def test_stop_strings_on_the_graph_path_cut_where_the_eager_loop_does(graph_engine, eager_engine):
    free = flat(gen(eager_engine, temperature=0, max_tokens=40))
    stops = [s.text[9:11] for s in free if len(s.text) > 12][:2]
    assert stops
    a = flat(gen(graph_engine, temperature=0, max_tokens=40, stop=stops))
    b = flat(gen(eager_engine, temperature=0, max_tokens=40, stop=stops))
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert [s.text for s in a] == [s.text for s in b] and [s.finish_reason for s in a] == [s.finish_reason for s in b]
    assert any(len(s.response_ids) < 40 for s in a)              # some row did stop early


def test_top_logprobs_on_the_graph_path_equal_the_eager_loops(graph_engine, eager_engine):
    before = graph_engine._graph_decoder.stats["replays"]
    a = flat(gen(graph_engine, temperature=0, max_tokens=20, top_logprobs=3))
    b = flat(gen(eager_engine, temperature=0, max_tokens=20, top_logprobs=3))
    assert graph_engine._graph_decoder.stats["replays"] > before
    for x, y in zip(a, b):
        assert x.response_ids == y.response_ids and len(x.top_logprobs) == len(x.response_ids)
        assert [[i for i, _ in step] for step in x.top_logprobs] == [[i for i, _ in step] for step in y.top_logprobs]
        assert max(abs(p - q) for sx, sy in zip(x.top_logprobs, y.top_logprobs)
                   for (_, p), (_, q) in zip(sx, sy)) < 1e-4


# ---- continuous batching: rows join a running captured decode (services/rollout/engine_torch/continuous.py)


def test_rows_that_join_a_captured_decode_give_the_tokens_they_give_alone(graph_engine):
    from services.rollout.engine_torch.cuda_decode import Joiner

    dec = graph_engine._graph_decoder
    joiners, budgets = [Joiner([9, 9, 8], 24, 0.0, 1.0), Joiner([5, 6, 7, 8, 9, 10], 40, 0.0, 1.0)], [8, 60, 20]
    alone = [dec.decode([q], [b], [0.0], [1.0]) for q, b in zip(PROMPTS, budgets)]
    alone += [dec.decode([j.prompt], [j.budget], [0.0], [1.0]) for j in joiners]
    waiting, before = list(joiners), dec.stats["joined_rows"]

    def join(room):
        take = [j for j in waiting if room.step >= 16 and room.fits(len(j.prompt), j.budget)][:room.free]
        for j in take:
            waiting.remove(j)
        return take

    out = dec.decode(PROMPTS, budgets, [0.0] * 3, [1.0] * 3, join=join)
    assert dec.stats["joined_rows"] - before == 2 and not waiting
    for i, a in enumerate(alone):
        assert out.tokens[i] == a.tokens[0]
        assert max(abs(p - q) for p, q in zip(out.logprobs[i], a.logprobs[0])) < 1e-4


@pytest.mark.parametrize("kv_cache", ["none", "paged"])
def test_concurrent_requests_of_mixed_lengths_join_a_graph_decode_and_all_complete(model_dir, eager_engine, kv_cache):
    """Either graph decoder: the unpaged one's rows join at syncs, the paged cache's between its windows."""
    import threading

    eng = make_engine(model_dir, graphs=kv_cache == "none", max_batch_size=8, kv_cache=kv_cache)
    assert (eng._paged is not None and eng._paged.graphs is not None) is (kv_cache == "paged")
    shapes = [(PROMPTS[:1], 2, 100), (PROMPTS[1:], 1, 30), ([[9, 9, 8]], 3, 60), (PROMPTS, 1, 12),
              ([[5, 6, 7]], 2, 90), (PROMPTS[2:], 2, 5)]
    batches = [GenerateBatch([PromptInput(id=f"r{i}p{j}", prompt_ids=list(p)) for j, p in enumerate(ps)],
                             SamplingParams(n=n, temperature=0, max_tokens=t)) for i, (ps, n, t) in enumerate(shapes)]
    gen(eng, prompts=PROMPTS[:1], n=2, temperature=0, max_tokens=100)   # captures the first request's graph
    alone = [asyncio.run(eager_engine.generate(b)) for b in batches]
    reached, opened = threading.Event(), threading.Event()

    def hold_first_prefill(module, args):          # replays do not call it: prefills only
        if not reached.is_set():
            reached.set()
            assert opened.wait(120)

    async def main():
        handle = eng.model.model.embed_tokens.register_forward_pre_hook(hold_first_prefill)
        try:
            tasks = [asyncio.ensure_future(eng.generate(batches[0]))]
            assert await asyncio.to_thread(reached.wait, 120)
            tasks += [asyncio.ensure_future(eng.generate(b)) for b in batches[1:]]
            for _ in range(1000):
                if len(eng._pending) == len(batches) - 1:
                    break
                await asyncio.sleep(0)
            opened.set()
            return await asyncio.gather(*tasks)
        finally:
            handle.remove()

    got = asyncio.run(main())
    assert eng.stats["joined_rows"] > 0 and eng.stats["requests"] == 1 + len(batches)
    for g, a, (ps, n, _) in zip(got, alone, shapes):
        assert [r.prompt_id for r in g] == [r.prompt_id for r in a] and all(len(r.samples) == n for r in g)
        for x, y in zip(flat(g), flat(a)):
            assert x.response_ids == y.response_ids
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-4


def test_captures_survive_another_thread_allocating(model_dir):
    """A process that also trains (the in-process mesh, several runs on one mesh) allocates and frees device memory
    on other threads while the decoder captures: in the default global capture mode any such cudaMalloc fails the
    capture ('operation not permitted when stream is capturing'); graph_step.capture uses thread-local mode."""
    import threading

    engine = make_engine(model_dir, graphs=True, max_batch_size=16)
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn():
        try:
            while not stop.is_set():
                x = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")   # a fresh cudaMalloc each time
                x.fill_(1)
                del x
                torch.cuda.empty_cache()
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    t = threading.Thread(target=churn, daemon=True)
    t.start()
    try:
        for n in (1, 3, 9, 16):            # each batch bucket captures its own graph
            batch = GenerateBatch([PromptInput(id=str(i), prompt_ids=PROMPTS[i % 3]) for i in range(n)],
                                  SamplingParams(n=1, temperature=0.0, max_tokens=12))
            out = asyncio.run(engine.generate(batch))
            assert [len(s.response_ids) for r in out for s in r.samples] == [12] * n
    finally:
        stop.set()
        t.join(timeout=30)
    assert not errors, errors
    from services.rollout.types import bucket_batch

    assert engine._graph_decoder.stats["graphs_captured"] >= len({bucket_batch(n, 16) for n in (1, 3, 9, 16)})
