"""The graph decoder applies LoRA adapters by group (services/rollout/engine_torch/lora.py's LoraGroup, graph_step.py):
one shrink (rows under the group's fused base weights: the same GEMM) and one block-diagonal expand GEMM for q/k/v,
for gate/up, for o and for down, the row mask built once per step. Its deltas
equal the per-projection path's and the merged weights', and its decode of a batch mixing two adapters of different
ranks and base rows equals the eager per-projection loop and each adapter's merged model. The step runs eagerly on
CPU (use_graphs=False, compile=False), as tests/unit/test_continuous_batching.py runs it."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.rollout.config import RolloutSettings
from services.rollout.engine_torch.cuda_decode import GraphDecoder
from services.rollout.engine_torch.engine import TorchEngine, _Job
from services.rollout.engine_torch.lora import GATE_UP, QKV, grouped_delta
from services.rollout.testing import make_tiny_model
from tests.unit.test_rollout_lora import assert_same, batch, greedy, samples, trained_adapter


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("lora_grouped_model"))


@pytest.fixture(scope="module")
def adapters(model_dir):
    """Two trained adapters of different ranks and scales: {name: (tensors, config, merged weights)}."""
    return {"a": trained_adapter(model_dir, seed=21, rank=4, alpha=8.0),
            "b": trained_adapter(model_dir, seed=22, rank=8, alpha=32.0)}


def lora_engine(model_dir, adapters, *, graph: bool) -> TorchEngine:
    e = TorchEngine(RolloutSettings(model={"path": model_dir}, rollout={"enable_lora": True, "max_loras": 3,
                                                                        "max_lora_rank": 8, "max_batch_size": 8}))
    if graph:       # the engine refuses rollout.cuda_graphs without CUDA: the same decoder, its step run eagerly
        e._graph_decoder = GraphDecoder(e.model, pad_id=e.pad_id, eos_ids=sorted(e.eos_ids), max_batch_size=8,
                                        use_graphs=False, compile=False)
    for name, (tensors, config, _) in adapters.items():
        e.load_adapter(name, 1, config, tensors)
    return e


def merged_engine(model_dir, merged=None) -> TorchEngine:
    e = TorchEngine(RolloutSettings(model={"path": model_dir}, rollout={"enable_lora": False}))
    if merged is not None:
        asyncio.run(e.apply_update(1, merged))
    return e


def test_each_groups_delta_equals_the_per_projection_deltas_and_the_merged_weights(model_dir, adapters):
    e = lora_engine(model_dir, adapters, graph=False)
    bank = e.adapters
    a, b = bank.slot_of("a"), bank.slot_of("b")
    rows = [a, 0, b, a, b, 0]
    g = torch.Generator().manual_seed(0)
    checked = 0
    with torch.no_grad(), bank.rows_for(rows):
        mask = bank.step_mask(len(rows))
        for i, layer in enumerate(e.model.model.layers):
            for parent, names in ((layer.self_attn, QKV), (layer.self_attn, ("o_proj",)), (layer.mlp, GATE_UP),
                                  (layer.mlp, ("down_proj",))):
                mods = [getattr(parent, n) for n in names]
                group = bank.group(parent, names)
                x = torch.randn((len(rows), 1, mods[0].in_features), generator=g)
                got = grouped_delta(x, group.A, group.B, mask)
                per_projection = torch.cat([m.lora_delta(x) for m in mods], dim=-1)
                torch.testing.assert_close(got, per_projection, atol=1e-5, rtol=0)
                # Against the merged weights: row r's delta is x (W_merged - W_base)^T of its adapter, 0 for base rows.
                for r, slot in enumerate(rows):
                    if slot == 0:
                        assert not got[r].any()
                        continue
                    merged = adapters["a" if slot == a else "b"][2]
                    path = f"model.layers.{i}.{'self_attn' if parent is layer.self_attn else 'mlp'}"
                    w = torch.cat([merged[f"{path}.{n}.weight"] - m.weight for n, m in zip(names, mods)])
                    torch.testing.assert_close(got[r], x[r] @ w.T, atol=1e-4, rtol=1e-4)
                    checked += 1
    assert checked == len(e.model.model.layers) * 4 * 4
    # The block-diagonal B is zero off its blocks: q's columns never reach k's or v's rows.
    layer = e.model.model.layers[0]
    B, W, out_q = bank.group(layer.self_attn, QKV).B, bank.width, layer.self_attn.q_proj.out_features
    assert B[:out_q, :W].any() and not B[out_q:, :W].any() and not B[:out_q, W:].any()


def assert_same_as_merged(a, b):
    """Same tokens; log-probs within fp32 noise of the merged weights (W + s*B@A summed before the GEMM, where the
    grouped step adds x@A then @B after it): the trained adapters' deltas are large, so the two orders differ by a few
    1e-5 and by how the CPU's kernels block the sums (2.8e-5 on one machine, under 2e-5 on another); the bound of
    tests/unit/test_paged_kv_lora.py's assert_same, for the same two orders."""
    for x, y in zip(samples(a), samples(b), strict=True):
        assert x.response_ids == y.response_ids
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("fused", [True, False])
def test_a_mixed_batch_on_the_grouped_graph_step_equals_the_eager_loop_and_the_merged_models(model_dir, adapters,
                                                                                            fused):
    graph, eager = lora_engine(model_dir, adapters, graph=True), lora_engine(model_dir, adapters, graph=False)
    dec = graph._graph_decoder
    assert dec.adapters is graph.adapters
    # Every group's A sits under its members' weights (one GEMM gives base and shrink), the parameters are views of
    # the same buffer, and the adapters, loaded after the decoder was built through the layers' views, are there.
    attn = graph.model.model.layers[0].self_attn
    w, _, A, B, kernel = dec._proj[0][0]
    assert kernel is None and dec._by_torch and not dec._by_kernel      # CPU: the torch ops (lora_expand is CUDA's)
    group = graph.adapters.group(attn, QKV)
    assert A is None and B is group.B and group.A.any()
    assert group.A.data_ptr() == w[w.shape[0] - group.A.shape[0]:].data_ptr()
    assert attn.q_proj.lora_A_cat.data_ptr() == group.A.data_ptr() and attn.q_proj.weight.data_ptr() == w.data_ptr()
    assert attn.k_proj.weight.data_ptr() == w[attn.q_proj.out_features:].data_ptr()
    assert all(p[0] is not None for p in dec._proj[0])               # o and down fused with their A too
    if not fused:       # each member's own GEMM and the group's shrink apart: the group's delta split onto each
        dec._proj = [tuple((None, None, g.A, g.B, None) for g in (graph.adapters.group(layer.self_attn, QKV),
                                                           graph.adapters.group(layer.self_attn, ("o_proj",)),
                                                           graph.adapters.group(layer.mlp, GATE_UP),
                                                           graph.adapters.group(layer.mlp, ("down_proj",))))
                     for layer in graph.model.model.layers]
    requests = [batch(greedy("a", n=2)), batch(greedy("")), batch(greedy("b"))]
    mixed = graph._generate_jobs([_Job(r, graph.check_batch(r), None) for r in requests])
    assert dec.stats["replays"] > 0                                     # the graph step decoded them
    for got, want in zip(mixed, eager._generate_jobs([_Job(r, eager.check_batch(r), None) for r in requests]),
                         strict=True):
        assert_same(got, want)
    for got, merged in zip(mixed, (adapters["a"][2], None, adapters["b"][2])):
        want = merged_engine(model_dir, merged).generate_sync(batch(greedy(n=len(samples(got)) // 3)))
        assert_same_as_merged(got, want)
    lp = [samples(m)[0].logprobs for m in mixed]
    assert lp[0] != lp[1] and lp[1] != lp[2] and lp[0] != lp[2]      # each row got its own adapter
    assert not graph.adapters.rows.any()                              # forwards after the decode read base rows


def test_fused_parameters_swapped_by_reference_go_back_into_their_buffer_and_updates_in_place_land_there(model_dir,
                                                                                                       adapters):
    e = lora_engine(model_dir, adapters, graph=True)
    dec, mlp = e._graph_decoder, e.model.model.layers[1].mlp
    w = dec._proj[1][2][0]                                      # layer 1's gate/up buffer
    want = torch.randn(mlp.up_proj.weight.shape, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        mlp.up_proj.weight.data = want.clone()                 # by reference: no longer a view of the buffer
    assert not torch.equal(w[mlp.gate_proj.out_features:mlp.gate_proj.out_features * 2], want)
    dec.refresh_weights()
    assert mlp.up_proj.weight.data_ptr() == w[mlp.gate_proj.out_features:].data_ptr()
    assert torch.equal(w[mlp.gate_proj.out_features:mlp.gate_proj.out_features * 2], want)
    with torch.no_grad():
        mlp.gate_proj.weight.mul_(2)                            # in place: the buffer sees it at once
    assert torch.equal(w[:mlp.gate_proj.out_features], mlp.gate_proj.weight)
    # The adapters' A rows under the base rows are untouched by either.
    assert torch.equal(w[2 * mlp.gate_proj.out_features:], e.adapters.group(mlp, GATE_UP).A)
