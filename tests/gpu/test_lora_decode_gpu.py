"""GPU tests of LoRA serving on the CUDA-graph decode (services/rollout/engine_torch/lora.py): captured graphs read
the rows' adapter slots and the stacked adapter buffers by address, so a batch mixing adapters, and an adapter
replaced after capture, decode as the eager loop does. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from services.rollout.config import RolloutSettings
from services.rollout.engine_torch.engine import TorchEngine, _Job
from services.rollout.testing import make_tiny_model
from tests.unit.test_rollout_lora import batch, greedy, samples, trained_adapter

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("lora_gpu_model"), max_position_embeddings=512)


def make_engine(path: str, *, graphs: bool, compile: bool = False) -> TorchEngine:
    return TorchEngine(RolloutSettings(model={"path": path, "device": "cuda", "dtype": "float32"},
                                       rollout={"cuda_graphs": graphs, "cuda_graph_compile": compile,
                                                "max_batch_size": 16, "enable_lora": True, "max_loras": 3, "kv_cache": "none",
                                                "max_lora_rank": 8}))


def assert_same(a, b, atol: float = 1e-4):
    """Same tokens; log-probs within the graph decoder's fp32 tolerance (tests/gpu/test_cuda_decode.py's)."""
    for x, y in zip(samples(a), samples(b), strict=True):
        assert x.response_ids == y.response_ids
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=atol, rtol=0)


def load(engines, name: str, seed: int, model_dir: str, version: int = 1, rank: int = 4) -> None:
    tensors, config, _ = trained_adapter(model_dir, seed=seed, rank=rank)
    for e in engines:
        e.load_adapter(name, version, config, tensors)


def mixed(engine, requests):
    return engine._generate_jobs([_Job(b, engine.check_batch(b), None) for b in requests])


@pytest.mark.parametrize("compile", [False, True])
def test_a_mixed_adapter_batch_on_cuda_graphs_equals_the_eager_loop(model_dir, compile):
    graphs, eager = make_engine(model_dir, graphs=True, compile=compile), make_engine(model_dir, graphs=False)
    assert graphs._graph_decoder is not None and graphs._graph_decoder.adapters is graphs.adapters
    # every group's adapters applied by lora_expand's kernel (the tiny model's widths are multiples of 16)
    assert graphs._graph_decoder._by_kernel and not graphs._graph_decoder._by_torch
    load((graphs, eager), "a", 1, model_dir)
    load((graphs, eager), "b", 2, model_dir, rank=8)
    requests = [batch(greedy("a", n=2)), batch(greedy("")), batch(greedy("b"))]
    got, want = mixed(graphs, requests), mixed(eager, requests)
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)
    # each request alone on the graphs gives what it got in the mix
    for r, g in zip(requests, got):
        assert_same(graphs.generate_sync(r), g)


def test_an_adapter_replaced_after_capture_is_what_the_graphs_decode(model_dir):
    graphs, eager = make_engine(model_dir, graphs=True), make_engine(model_dir, graphs=False)
    load((graphs, eager), "a", 1, model_dir)
    first = graphs.generate_sync(batch(greedy("a")))          # captures the graphs with the first adapter
    load((graphs, eager), "a", 2, model_dir, version=2)
    captured = graphs._graph_decoder.stats["graphs_captured"]
    again = graphs.generate_sync(batch(greedy("a")))
    assert graphs._graph_decoder.stats["graphs_captured"] == captured      # the same graphs replayed
    assert_same(again, eager.generate_sync(batch(greedy("a"))))
    assert [s.logprobs for r in again for s in r.samples] != [s.logprobs for r in first for s in r.samples]
