"""The paged KV cache's decode step (services/rollout/engine_torch/paged/forward.py DecodeStep, the step paged/graphs.py
captures) runs the CUDA-graph decoder's layers (decode_layers.py): fused q/k/v and gate/up GEMMs, LoRA by group with
one row mask per step, the layer body compiled with `compile`. Its logits are the model's own forward's for rows of
two adapters and the base mixed, padded to the bucket with base dummy rows; compiled equals eager; the fused buffers
are shared with a graph decoder on the same model and follow weights swapped by reference. On CPU the step attends
with torch ops; the Triton kernel's custom op runs in Triton's CPU interpreter (slow)."""

from __future__ import annotations

import textwrap

import pytest
import torch

from services.common.tensors.modeling import load_causal_lm
from services.rollout.engine_torch.cuda_decode import GraphDecoder
from services.rollout.engine_torch.fused_weights import fuse
from services.rollout.engine_torch.lora import DEFAULT_TARGETS, PREFIX, AdapterBank, adapter_rows
from services.rollout.engine_torch.paged.blocks import BlockPool, BlockTable
from services.rollout.engine_torch.paged.forward import paged_forward
from services.rollout.engine_torch.paged.graphs import PagedGraphs
from services.rollout.engine_torch.paged.kv import PagedKV
from services.rollout.testing import make_tiny_model
from tests.interpreted import assert_printed_ok, run_interpreted

BS, WIDTH, BUCKET = 16, 4, 8
LENGTHS = (5, 40, 17, 33, 40)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("paged_step_model"), max_position_embeddings=256)


def adapter(bank: AdapterBank, rank: int, seed: int) -> tuple[dict, dict]:
    """A random adapter of `rank` on every layer the bank serves: (PEFT-named tensors, its config)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for path, m in bank.layers.items():
        tensors[f"{PREFIX}{path}.lora_A.weight"] = torch.randn((rank, m.in_features), generator=g) * 0.3
        tensors[f"{PREFIX}{path}.lora_B.weight"] = torch.randn((m.out_features, rank), generator=g) * 0.3
    return tensors, {"r": rank, "lora_alpha": 2.0 * rank}


def lora_model(model_dir: str):
    """The tiny model with a bank of adapters a (rank 4) and b (rank 8): (model, bank, slot of a, slot of b)."""
    model = load_causal_lm(model_dir, dtype="float32", device="cpu")
    bank = AdapterBank(model, max_loras=3, max_rank=8, targets=DEFAULT_TARGETS, max_rows=BUCKET)
    for name, rank, seed in (("a", 4, 1), ("b", 8, 2)):
        tensors, config = adapter(bank, rank, seed)
        bank.load(name, config, tensors)
    return model, bank, bank.slot_of("a"), bank.slot_of("b")


def rows(model, slots) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]
    seqs[4] = list(seqs[1])                                  # row 1's tokens again, under another adapter
    return seqs, list(slots)


def prefilled(model, bank, seqs, slots) -> tuple[PagedKV, BlockPool, torch.Tensor]:
    """Every row's tokens but its last through the eager paged forward: (kv, pool, host tables [R, WIDTH])."""
    cfg = model.config
    kv = PagedKV(num_layers=cfg.num_hidden_layers, num_kv=cfg.num_key_value_heads, head_dim=16, num_blocks=32,
                 block_size=BS, dtype=torch.float32, device="cpu")
    pool = BlockPool(32, BS)
    tables = []
    for q in seqs:
        t = BlockTable()
        pool.reserve(t, len(q))
        tables.append(t.blocks + [t.blocks[0]] * (WIDTH - len(t.blocks)))
    with torch.no_grad(), adapter_rows(bank, slots):
        paged_forward(model, kv, tables, [0] * len(seqs), [q[:-1] for q in seqs], kernel=False)
    return kv, pool, torch.tensor(tables, dtype=torch.long)


def own_forward(model, bank, seqs, slots) -> torch.Tensor:
    """Each row's last logits from the model's own forward (LoRA per layer), alone: [R, V]."""
    out = []
    with torch.no_grad():
        for q, s in zip(seqs, slots):
            with adapter_rows(bank, [s]):
                out.append(model(input_ids=torch.tensor([q])).logits[0, -1].float())
    return torch.stack(out)


def static_step(model, bank, seqs, slots, *, compile: bool = False) -> tuple[torch.Tensor, PagedGraphs]:
    """The graph path's static padded step (no capture) on the rows' last tokens: (logits [R, V], its graphs). The
    step calls no linear layer's own forward (asserted by counting them)."""
    kv, pool, tables = prefilled(model, bank, seqs, slots)
    graphs = PagedGraphs(model, kv, width=WIDTH, scratch_block=pool.allocate(), max_batch_size=BUCKET,
                         use_graphs=False, kernel=False, compile=compile)
    calls = []
    hooks = [m.register_forward_hook(lambda m, *_: calls.append(m)) for m in model.modules()
             if isinstance(m, torch.nn.Linear) and m is not model.lm_head]
    try:
        out = graphs.forward([q[-1] for q in seqs], [len(q) - 1 for q in seqs], tables, slots)
    finally:
        for h in hooks:
            h.remove()
    assert calls == []                   # the fused groups ran instead (and no layer's per-layer adapter delta)
    return out, graphs


def next_step(graphs: PagedGraphs, logits: torch.Tensor, slots) -> tuple[torch.Tensor, torch.Tensor]:
    """A window's next step (positions advanced on the device) on each row's greedy token: (its logits, tokens)."""
    tok = logits.argmax(-1)
    return graphs.forward(tok, None, None, slots), tok


def test_the_paged_static_step_with_fused_grouped_layers_gives_the_models_own_logits_for_mixed_adapter_rows(
        model_dir):
    model, bank, a, b = lora_model(model_dir)
    seqs, slots = rows(model, (a, 0, b, a, b))             # 5 rows in a bucket of 8: 3 dummy (base) rows
    want = own_forward(model, bank, seqs, slots)
    got, graphs = static_step(model, bank, seqs, slots)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    then, tok = next_step(graphs, got, slots)             # over the K/V the step wrote into the pool
    longer = [q + [t] for q, t in zip(seqs, tok.tolist())]
    torch.testing.assert_close(then, own_forward(model, bank, longer, slots), atol=1e-4, rtol=1e-4)
    assert bank.rows[:5].tolist() == slots and not bank.rows[5:].any()     # the dummy rows read as the base's
    # The adapters change the logits (else the parity proves nothing): rows 1 (base) and 4 (b) are the same tokens.
    assert (got[1] - got[4]).abs().max() > 1e-2
    # The step's projections are the fused buffers with each group's A under them (one GEMM: base and shrink).
    attn = model.model.layers[0].self_attn
    w, _, A, B, _ = graphs.step._proj[0][0]
    assert A is None and B is bank.group(attn, ("q_proj", "k_proj", "v_proj")).B
    assert attn.q_proj.weight.data_ptr() == w.data_ptr() and attn.q_proj.lora_A_cat.data_ptr() == w[
        w.shape[0] - bank.group(attn, ("q_proj", "k_proj", "v_proj")).A.shape[0]:].data_ptr()


def test_the_paged_static_step_without_adapters_gives_the_models_own_logits(model_dir):
    model = load_causal_lm(model_dir, dtype="float32", device="cpu")
    seqs, _ = rows(model, [0] * 5)
    got, graphs = static_step(model, None, seqs, [0] * 5)
    torch.testing.assert_close(got, own_forward(model, None, seqs, [0] * 5), atol=1e-4, rtol=1e-4)
    assert graphs.step._proj[0][1] == (None, None, None, None, None)     # o and down stay alone without adapters
    assert model.model.layers[1].mlp.up_proj.weight.data_ptr() == graphs.step._proj[1][2][0][
        model.model.layers[1].mlp.gate_proj.out_features:].data_ptr()


def test_the_compiled_paged_step_equals_the_eager_one(model_dir):
    """rollout.cuda_graph_compile's path (one compiled layer for every layer, inductor on CPU here)."""
    model, bank, a, b = lora_model(model_dir)
    seqs, slots = rows(model, (a, 0, b, a, b))
    eager, plain = static_step(model, bank, seqs, slots)
    torch._dynamo.reset()
    compiled, graphs = static_step(model, bank, seqs, slots, compile=True)
    assert graphs.step._layer_fn is not graphs.step._layer
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)
    # The compiled layer writes its K/V into the pool in place: the next step reads them.
    torch.testing.assert_close(next_step(graphs, compiled, slots)[0], next_step(plain, eager, slots)[0], atol=1e-4,
                               rtol=1e-4)


def test_a_graph_decoder_and_the_paged_step_on_one_model_share_the_fused_buffers(model_dir):
    model, bank, a, b = lora_model(model_dir)
    dec = GraphDecoder(model, pad_id=0, eos_ids=[2], max_batch_size=BUCKET, use_graphs=False, compile=False)
    ptrs = [p.data_ptr() for p in model.parameters()]
    seqs, slots = rows(model, (a, 0, b, a, b))
    got, graphs = static_step(model, bank, seqs, slots)
    assert [p.data_ptr() for p in model.parameters()] == ptrs                # fused once: no parameter moved
    for mine, theirs in zip(graphs.step._proj, dec._proj, strict=True):
        assert all(x is y for g, h in zip(mine, theirs) for x, y in zip(g, h))
    torch.testing.assert_close(got, own_forward(model, bank, seqs, slots), atol=1e-4, rtol=1e-4)
    mlp = model.model.layers[0].mlp
    with pytest.raises(ValueError, match="fused already in another group"):
        fuse([mlp.up_proj, mlp.gate_proj], bank.group(mlp, ("gate_proj", "up_proj")))


def test_weights_swapped_by_reference_reach_the_paged_step_before_its_next_step(model_dir):
    model, bank, a, b = lora_model(model_dir)
    seqs, slots = rows(model, (a, 0, b, a, b))
    _, graphs = static_step(model, bank, seqs, slots)
    mlp = model.model.layers[1].mlp
    with torch.no_grad():
        mlp.up_proj.weight.data = torch.randn(mlp.up_proj.weight.shape, generator=torch.Generator().manual_seed(5))
    want = own_forward(model, bank, seqs, slots)              # the model's own forward reads the new weight
    kv, pool, tables = prefilled(model, bank, seqs, slots)
    graphs.kv.k, graphs.kv.v = kv.k, kv.v                     # the new weights' prefix (same pool shapes)
    got = graphs.forward([q[-1] for q in seqs], [len(q) - 1 for q in seqs], tables, slots)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert mlp.up_proj.weight.data_ptr() == graphs.step._proj[1][2][0][mlp.gate_proj.out_features:].data_ptr()


@pytest.mark.slow
def test_the_paged_kernels_custom_op_is_one_opaque_node_and_the_kernel_step_equals_the_torch_one(model_dir):
    """In Triton's CPU interpreter: meshrl::paged_decode_attention passes torch.library.opcheck, the kernel step
    (eager and compiled) gives the torch-attention step's logits, and the compiled layer's graph holds the op as one
    node."""
    pytest.importorskip("triton")
    script = textwrap.dedent(f"""
        import torch
        from services.rollout.engine_torch.paged import attention
        from services.rollout.engine_torch.paged.forward import DecodeStep
        from tests.unit.test_paged_kv_step import lora_model, prefilled, rows
        model, bank, a, b = lora_model({model_dir!r})
        seqs, slots = rows(model, (a, 0, b, a, b))
        kv, pool, tables = prefilled(model, bank, seqs, slots)
        ids = torch.tensor([[q[-1]] for q in seqs])
        pos = torch.tensor([[len(q) - 1] for q in seqs])
        ctx = pos[:, 0] + 1
        q = torch.randn(5, 4, 16)
        torch.library.opcheck(torch.ops.meshrl.paged_decode_attention.default,
                              (q, kv.k[0], kv.v[0], tables, ctx, 16, 0.25))
        snapshot = [t.clone() for t in kv.k + kv.v]
        out = {{}}
        for name, kernel, compile in (("torch", False, False), ("kernel", True, False), ("compiled", True, True)):
            for t, s in zip(kv.k + kv.v, snapshot):
                t.copy_(s)
            step = DecodeStep(model, kv, kernel=kernel, compile=compile)
            with torch.no_grad(), bank.rows_for(slots):
                out[name] = step(ids, pos, tables, ctx)
        for name in ("kernel", "compiled"):
            assert (out[name] - out["torch"]).abs().max() < 1e-3, (name, (out[name] - out["torch"]).abs().max())
        graphs = []
        def backend(gm, inputs):
            graphs.append(gm)
            return gm.forward
        torch._dynamo.reset()
        step = DecodeStep(model, kv, kernel=True, compile=False)
        layer_fn = torch.compile(step._layer, fullgraph=True, backend=backend)
        m = model.model
        x = m.embed_tokens(ids)
        cos, sin = m.rotary_emb(x, pos)
        from services.rollout.engine_torch.paged.forward import slots_of
        with torch.no_grad(), bank.rows_for(slots):
            layer_fn(m.layers[0], x, cos, sin, step._proj[0], step._step_mask(x), kv.k[0], kv.v[0],
                     slots_of(tables, pos, 16)[:, 0], tables, ctx, None, None)
        ops = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
        assert len(graphs) == 1 and ops.count(torch.ops.meshrl.paged_decode_attention.default) == 1, ops
        print("ok")
    """)
    assert_printed_ok(run_interpreted(script, timeout=900))
