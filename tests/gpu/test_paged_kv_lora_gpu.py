"""GPU tests of LoRA adapters on the paged KV cache's CUDA-graph decode (rollout.kv_cache_cuda_graphs with
rollout.enable_lora): each step copies the rows' adapter slots into the bank's static rows before the replay, so a batch
mixing two adapters and the base decodes as the unpaged LoRA loop and the eager paged steps do, and an adapter
replaced after capture is what the same graphs decode. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from services.rollout.config import RolloutSettings
from services.rollout.engine_torch.engine import TorchEngine, _Job
from services.rollout.testing import make_tiny_model
from services.rollout.types import GenerateBatch, PromptInput, SamplingParams
from tests.unit.test_rollout_lora import PROMPTS, samples, trained_adapter

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("paged_lora_gpu_model"), max_position_embeddings=512)


def make_engine(path: str, *, dtype: str = "float32", **rollout) -> TorchEngine:
    return TorchEngine(RolloutSettings(model={"path": path, "device": "cuda", "dtype": dtype},
                                       rollout={"cuda_graphs": False, "cuda_graph_compile": False, "max_batch_size": 16,
                                                "enable_lora": True, "max_loras": 3, "max_lora_rank": 8, **rollout}))


def paged(path: str, *, graphs: bool, dtype: str = "float32") -> TorchEngine:
    return make_engine(path, dtype=dtype, kv_cache="paged", kv_block_size=16, kv_cache_gib=0.01,
                       kv_cache_cuda_graphs=graphs)


def load(engines, name: str, seed: int, model_dir: str, *, version: int = 1, rank: int = 4) -> None:
    tensors, config, _ = trained_adapter(model_dir, seed=seed, rank=rank)
    for e in engines:
        e.load_adapter(name, version, config, tensors)


def request(adapter: str, **sampling) -> GenerateBatch:
    p = SamplingParams(**{"temperature": 0.0, "max_tokens": 32, **sampling, "adapter": adapter})
    return GenerateBatch([PromptInput(id=f"p{i}", prompt_ids=list(q)) for i, q in enumerate(PROMPTS)], p)


def mixed(engine, requests):
    return engine._generate_jobs([_Job(b, engine.check_batch(b), None) for b in requests])


def assert_same(a, b, atol: float):
    for x, y in zip(samples(a), samples(b), strict=True):
        assert x.response_ids == y.response_ids
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=atol, rtol=0)


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=1.0, seed=4)])
def test_paged_graph_steps_of_mixed_adapters_equal_the_unpaged_lora_loop(model_dir, sampling):
    # Seeded rows on CUDA draw the fused sampler's stream (paged/sample.py): the unpaged CUDA-graph decoder's draws.
    graphs, eager = paged(model_dir, graphs=True), make_engine(model_dir, cuda_graphs=bool(sampling))
    assert graphs._paged.graphs.adapters is graphs.adapters
    load((graphs, eager), "a", 1, model_dir)
    load((graphs, eager), "b", 2, model_dir, rank=8)
    requests = [request("a", n=2, **sampling), request("", **sampling), request("b", n=3, **sampling)]
    got, want = mixed(graphs, requests), mixed(eager, requests)
    for g, w in zip(got, want, strict=True):
        assert_same(g, w, atol=1e-3)
    lp = [samples(g)[0].logprobs for g in got]
    assert lp[0] != lp[1] and lp[1] != lp[2]                 # each row decoded under its own adapter
    st = graphs._paged.graphs.stats
    assert st["graphs_captured"] >= 1 and st["replays"] > 0
    assert not graphs.adapters.rows.any()                    # zeroed after the decode: later forwards read base rows


@pytest.mark.parametrize("dtype,atol", [("float32", 1e-3), ("bfloat16", 0.1)])
def test_paged_graph_steps_of_mixed_adapters_equal_the_eager_paged_steps(model_dir, dtype, atol):
    graphs, eager = paged(model_dir, graphs=True, dtype=dtype), paged(model_dir, graphs=False, dtype=dtype)
    load((graphs, eager), "a", 1, model_dir)
    load((graphs, eager), "b", 2, model_dir, rank=8)
    requests = [request("b", n=2), request(""), request("a", n=2, temperature=1.0, seed=9)]
    for g, w in zip(mixed(graphs, requests), mixed(eager, requests), strict=True):
        assert_same(g, w, atol=atol)


def test_an_adapter_replaced_after_capture_is_what_the_paged_graphs_decode(model_dir):
    graphs, eager = paged(model_dir, graphs=True), make_engine(model_dir)
    load((graphs, eager), "a", 1, model_dir)
    first = graphs.generate_sync(request("a"))               # captures the graphs under the first load
    load((graphs, eager), "a", 3, model_dir, version=2)
    captured = graphs._paged.graphs.stats["graphs_captured"]
    again = graphs.generate_sync(request("a"))
    assert graphs._paged.graphs.stats["graphs_captured"] == captured      # the same graphs replayed
    assert_same(again, eager.generate_sync(request("a")), atol=1e-3)
    assert [s.logprobs for s in samples(again)] != [s.logprobs for s in samples(first)]
