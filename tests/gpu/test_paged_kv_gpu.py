"""GPU tests of the torch engine's paged KV cache (services/rollout/engine_torch/paged/); skipped without CUDA."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.common.tensors.modeling import response_logprobs
from services.rollout.config import RolloutSettings
from services.rollout.engine_torch.engine import TorchEngine
from services.rollout.testing import make_tiny_model
from services.rollout.types import GenerateBatch, PromptInput, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[4, 5, 13, 6, 15], [7, 3, 9, 12, 8, 10, 11, 14, 16, 4, 4, 5], [20]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("paged_gpu_model"), max_position_embeddings=512)


def make_engine(path: str, *, dtype: str = "float32", **rollout) -> TorchEngine:
    return TorchEngine(RolloutSettings(model={"path": path, "device": "cuda", "dtype": dtype},
                                       rollout={"cuda_graph_compile": False, **rollout}))


def gen(engine, prompts=PROMPTS, **sampling):
    batch = GenerateBatch([PromptInput(id=f"p{i}", prompt_ids=list(p)) for i, p in enumerate(prompts)],
                          SamplingParams(**sampling))
    return [s for r in asyncio.run(engine.generate(batch)) for s in r.samples]


@pytest.mark.parametrize("dtype,atol", [("float32", 1e-4), ("bfloat16", 0.1)])
def test_paged_decode_on_cuda_matches_a_full_forward(model_dir, dtype, atol):
    eng = make_engine(model_dir, dtype=dtype, kv_cache="paged", kv_block_size=16, kv_cache_gib=0.01)
    samples = gen(eng, n=4, temperature=1.0, seed=3, max_tokens=40)
    prompts = [p for p in PROMPTS for _ in range(4)]
    lp, _ = response_logprobs(eng.model, prompts, [s.response_ids for s in samples], pad_id=eng.pad_id)
    for i, s in enumerate(samples):
        assert torch.allclose(torch.tensor(s.logprobs), lp[i, :len(s.response_ids)].cpu(), atol=atol, rtol=0), i
    m = eng.info()
    # Every row's blocks are back in the pool; the CUDA graphs' scratch block (dummy rows') stays out of it.
    assert m["prefill_tokens"] == sum(map(len, PROMPTS))
    assert m["kv_blocks_used"] == int(eng._paged.graphs is not None)


def test_paged_greedy_tokens_equal_the_cuda_graph_decodes(model_dir):
    graph = make_engine(model_dir, cuda_graphs=True, max_batch_size=16)
    paged = make_engine(model_dir, kv_cache="paged", kv_block_size=16)
    a = gen(graph, n=2, temperature=0.0, max_tokens=48)
    b = gen(paged, n=2, temperature=0.0, max_tokens=48)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    for x, y in zip(a, b):
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-3, rtol=0)


def test_preemption_on_cuda_resumes_with_the_same_seeded_samples(model_dir):
    full = make_engine(model_dir, kv_cache="paged", kv_block_size=4)
    per_block = 2 * 2 * 2 * 16 * 4 * 4                      # K+V, 2 layers, 2 kv heads, head_dim 16, 4 tokens, fp32
    small = make_engine(model_dir, kv_cache="paged", kv_block_size=4, kv_cache_gib=20 * per_block / 2**30)
    sampling = dict(n=4, temperature=1.0, seed=9, max_tokens=24)
    a, b = gen(full, **sampling), gen(small, **sampling)
    assert small.info()["preemptions"] > 0
    assert [s.response_ids for s in a] == [s.response_ids for s in b]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_paged_cuda_graph_steps_sample_what_the_eager_paged_steps_sample(model_dir, dtype):
    eager = make_engine(model_dir, dtype=dtype, kv_cache="paged", kv_block_size=16, kv_cache_gib=0.01)
    graphs = make_engine(model_dir, dtype=dtype, kv_cache="paged", kv_block_size=16, kv_cache_gib=0.01,
                         kv_cache_cuda_graphs=True)
    for sampling in (dict(n=3, temperature=0.0, max_tokens=40), dict(n=4, temperature=1.0, seed=2, max_tokens=40)):
        a, b = gen(eager, **sampling), gen(graphs, **sampling)
        assert [s.response_ids for s in a] == [s.response_ids for s in b]
        for x, y in zip(a, b):
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-3, rtol=0)
    assert graphs._paged.graphs.stats["graphs_captured"] >= 1 and graphs._paged.graphs.stats["replays"] > 0


def test_compiled_paged_graph_steps_give_the_compiled_unpaged_decoders_tokens(model_dir):
    """The paged step runs GraphStep's compiled layer (fused q/k/v and gate/up, meshrl::paged_decode_attention as one
    node), captured per bucket: greedy rows decode what the compiled unpaged CUDA-graph decoder decodes."""
    unpaged = make_engine(model_dir, cuda_graphs=True, cuda_graph_compile=True, max_batch_size=16)
    paged = make_engine(model_dir, kv_cache="paged", kv_block_size=16, kv_cache_cuda_graphs=True,
                        cuda_graph_compile=True)
    a = gen(unpaged, n=2, temperature=0.0, max_tokens=48)
    b = gen(paged, n=2, temperature=0.0, max_tokens=48)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    for x, y in zip(a, b):
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-3, rtol=0)
    assert paged._paged.graphs.stats["graphs_captured"] >= 1 and paged._paged.graphs.stats["replays"] > 0


# ---- device-side sampling in windows of steps (paged/sample.py, paged/window.py)

@pytest.mark.parametrize("graphs", [False, True])
def test_paged_fused_windows_sample_the_unpaged_cuda_decoders_tokens(model_dir, graphs):
    """On CUDA the paged steps sample with the fused Triton sampler, 16 steps per host sync: greedy rows, and seeded
    rows (each row's Philox stream keyed by its seed, counter = its token index), get the non-paged CUDA-graph
    decoder's tokens and log-probs, though rows are admitted 4 at a time and a small pool preempts some."""
    unpaged = make_engine(model_dir, cuda_graphs=True, max_batch_size=16)
    paged = make_engine(model_dir, kv_cache="paged", kv_block_size=16, max_batch_size=4, kv_cache_cuda_graphs=graphs)
    tight = make_engine(model_dir, kv_cache="paged", kv_block_size=16, max_batch_size=8, kv_cache_cuda_graphs=graphs,
                        kv_cache_gib=14 * 2 * 2 * 2 * 16 * 16 * 4 / 2**30)        # 14 blocks of 16 tokens, fp32
    for sampling in (dict(n=2, temperature=0.0, max_tokens=48), dict(n=3, temperature=1.0, seed=5, max_tokens=48)):
        want = gen(unpaged, **sampling)
        for eng in (paged, tight):
            got = gen(eng, **sampling)
            assert [s.response_ids for s in got] == [s.response_ids for s in want], sampling
            for x, y in zip(got, want):
                assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-3, rtol=0)
    st = paged._paged.stats
    assert paged._paged.sampler.fused and 0 < 4 * st["decode_syncs"] < st["decode_steps"]
    assert tight.info()["preemptions"] > 0 and tight.info()["kv_blocks_used"] == int(graphs)


def test_paged_top_p_and_top_logprobs_rows_keep_the_torch_sampler(model_dir):
    """Where the fused sampler does not apply (a row with top_p < 1, or top-logprobs), the paged windows sample with
    the torch sampler and each row's generator: the eager loop's samples."""
    eager = make_engine(model_dir, cuda_graphs=False, max_batch_size=16)
    paged = make_engine(model_dir, kv_cache="paged", kv_block_size=16)
    for sampling in (dict(n=3, temperature=0.8, top_p=0.7, seed=4, max_tokens=40),
                     dict(n=2, temperature=1.0, seed=6, top_logprobs=3, max_tokens=40)):
        want, got = gen(eager, **sampling), gen(paged, **sampling)
        assert not paged._paged.sampler.fused
        assert [s.response_ids for s in got] == [s.response_ids for s in want], sampling
        for x, y in zip(got, want):
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-3, rtol=0)
            if sampling.get("top_logprobs"):
                assert [[t for t, _ in step] for step in x.top_logprobs] == [[t for t, _ in step]
                                                                             for step in y.top_logprobs]


def test_graph_steps_reading_shared_prefixes_once_per_group_sample_what_they_sample_without(model_dir, monkeypatch):
    """GRPO-like groups (n=4 and a group of 12, cut at the kernel's rows per group) forked from prompts of 1-4 full
    blocks: the captured steps with the shared-prefix attention (cascade.py) give the tokens and log-probs of the
    same steps without it (fp32: the two sum in different orders; bf16 ties could flip a token on this random
    model; bench/cascade_attention.py reports the bf16 difference at the kernel)."""
    from services.rollout.engine_torch.paged import cascade

    monkeypatch.setattr(cascade, "MIN_SHARED_TOKENS", 16)     # these short prefixes take the group path (arithmetic)
    dtype, atol = "float32", 1e-4
    prompts = [list(range(3, 33)) + list(range(3, 13)), [7, 8] * 11, [5] * 70, [9] * 7]
    def engine(shared: bool) -> TorchEngine:
        e = make_engine(model_dir, dtype=dtype, kv_cache="paged", kv_block_size=16, kv_cache_gib=0.05,
                        kv_cache_cuda_graphs=True)
        e._paged.graphs.shared_prefix = e._paged.graphs.shared_prefix and shared
        return e
    on, off = engine(True), engine(False)
    assert on._paged.graphs.shared_prefix
    for sampling in (dict(n=4, temperature=0.0, max_tokens=40), dict(n=12, temperature=1.0, seed=4, max_tokens=40)):
        a, b = gen(on, prompts, **sampling), gen(off, prompts, **sampling)
        assert [s.response_ids for s in a] == [s.response_ids for s in b]
        for x, y in zip(a, b):
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=atol, rtol=0)
    assert on._paged.graphs.stats["shared_prefix_rows"] > 0
    assert off._paged.graphs.stats["shared_prefix_rows"] == 0


@pytest.mark.parametrize("graphs", [False, True])
def test_chained_windows_launch_without_a_host_sync_and_sample_what_unchained_windows_sample(model_dir, graphs):
    """Each window after the first is launched before the host reads the one before it (window.py, chained windows):
    queuing it syncs nothing with the device (torch's sync debug mode raises on a sync), and rows that end inside a
    window (an eos drawn mid-window) and run on into the next one get the tokens and log-probs of windows that wait
    for the host (the fused sampler's counter is each row's token index)."""
    def engine(chain: bool) -> TorchEngine:
        e = make_engine(model_dir, kv_cache="paged", kv_block_size=16, kv_cache_cuda_graphs=graphs)
        e._paged.chain_windows = chain
        return e

    on, off = engine(True), engine(False)
    sampling = dict(n=4, temperature=1.0, seed=9, max_tokens=100)
    first = [s.response_ids for s in gen(off, **sampling)]
    # an eos drawn mid-window by row 0 (after its first windows) and never by some other row: both endings occur
    eos = next(t for p, t in enumerate(first[0]) if p >= 37 and first[0].index(t) == p
               and any(len(r) == sampling["max_tokens"] and t not in r for r in first[1:]))
    on.eos_ids = off.eos_ids = {eos}
    want = gen(off, **sampling)
    gen(on, **sampling)                                      # graphs captured (a capture syncs) before the check
    chain = on._paged._chain

    def strict(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return chain(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    on._paged._chain = strict
    before = on._paged.stats["chained_windows"]
    got = gen(on, **sampling)
    assert on._paged.stats["chained_windows"] > before and off._paged.stats["chained_windows"] == 0
    assert [s.response_ids for s in got] == [s.response_ids for s in want]
    assert any(s.finish_reason == "stop" for s in got) and any(s.finish_reason == "length" for s in got)
    for x, y in zip(got, want):
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-3, rtol=0)
    assert on.info()["kv_blocks_used"] == int(graphs) and off.info()["kv_blocks_used"] == int(graphs)


def test_short_shared_prompts_take_the_plain_path(model_dir):
    """A GRPO group's short prompt (2 blocks, under cascade.MIN_SHARED_TOKENS) costs less read per row than the group
    kernel's fixed grid: no window takes the shared-prefix path, and the samples are the same."""
    e = make_engine(model_dir, dtype="float32", kv_cache="paged", kv_block_size=16, kv_cache_cuda_graphs=True)
    prompt = [3 + i % 30 for i in range(32)]                # 2 blocks of 16 in the tiny model's 33-token vocabulary
    got = gen(e, [prompt], n=8, temperature=0.0, max_tokens=24)
    assert len(got) == 8 and e._paged.graphs.stats["shared_prefix_rows"] == 0
    assert e._paged.graphs.stats["replays"] > 0
