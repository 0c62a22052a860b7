"""The paged KV cache's Triton decode attention (services/rollout/engine_torch/paged/attention.py), run in Triton's
CPU interpreter: a decode step over block tables equals the torch path (gather + scaled_dot_product_attention)."""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.interpreted import assert_printed_ok, run_interpreted


@pytest.mark.slow
def test_the_triton_paged_decode_step_equals_the_torch_path_in_the_interpreter(tmp_path):
    pytest.importorskip("triton")
    from services.rollout.testing import make_tiny_model
    model_dir = make_tiny_model(tmp_path / "m", max_position_embeddings=256)
    # TRITON_INTERPRET is read when the kernels are decorated: a fresh interpreter runs them on CPU tensors.
    script = textwrap.dedent(f"""
        import torch
        from transformers import AutoModelForCausalLM
        from services.rollout.engine_torch.paged.blocks import BlockPool, BlockTable
        from services.rollout.engine_torch.paged.forward import paged_forward
        from services.rollout.engine_torch.paged.kv import PagedKV
        model = AutoModelForCausalLM.from_pretrained({str(model_dir)!r}).eval()
        cfg, bs = model.config, 16
        kv = PagedKV(num_layers=cfg.num_hidden_layers, num_kv=cfg.num_key_value_heads, head_dim=16,
                     num_blocks=32, block_size=bs, dtype=torch.float32, device="cpu")
        pool = BlockPool(32, bs)
        g = torch.Generator().manual_seed(0)
        seqs = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 40, 16, 33)]
        tables = []
        for q in seqs:
            t = BlockTable()
            pool.reserve(t, len(q) + 1)
            tables.append(t.blocks)
        paged_forward(model, kv, tables, [0] * 4, [q[:-1] for q in seqs], kernel=False)
        snapshot = [t.clone() for t in kv.k + kv.v]
        want = paged_forward(model, kv, tables, [len(q) - 1 for q in seqs], [q[-1:] for q in seqs], kernel=False)
        for t, s in zip(kv.k + kv.v, snapshot):
            t.copy_(s)
        got = paged_forward(model, kv, tables, [len(q) - 1 for q in seqs], [q[-1:] for q in seqs], kernel=True)
        assert (got - want).abs().max() < 1e-3, (got - want).abs().max()
        full = torch.stack([model(input_ids=torch.tensor([q])).logits[0, -1] for q in seqs])
        assert (got - full).abs().max() < 1e-3, (got - full).abs().max()
        print("ok")
    """)
    assert_printed_ok(run_interpreted(script))


# Kernel-level cases, run in one interpreter per dtype: (block_size, head_dim, heads, kv heads, context lengths,
# tile, partitions); None = the function's own choice. Contexts end mid-block and mid-tile, at 1 token, and differ
# widely within a batch; G = 7 (Qwen2.5-0.5B's 14 / 2) is not a power of two; split-K runs with partitions that get
# no tokens (short rows) and with P not a power of two.
KERNEL_CASES = [
    (16, 64, 14, 2, [1, 5, 16, 40, 129, 300], None, 1),       # tile 128: 8 blocks an iteration
    (16, 64, 14, 2, [1, 5, 16, 40, 129, 300], 16, 1),         # one block an iteration (the old kernel's walk)
    (16, 64, 14, 2, [1, 5, 16, 40, 129, 300], 64, None),      # auto partitions: 2 at this width
    (32, 128, 12, 2, [1, 31, 33, 64, 200], None, 1),          # tile 64: 2 blocks an iteration
    (64, 64, 4, 4, [1, 63, 65, 250], None, 1),                # G = 1; tile 128 of 64-token blocks
    (64, 128, 14, 2, [1, 63, 65, 250], 64, 1),                # block = tile
    (16, 64, 14, 2, [1, 5, 40, 300], None, 4),                # split-K, rows 1 and 5 leave partitions empty
    (32, 128, 12, 2, [1, 33, 200], 32, 3),
    (16, 64, 14, 2, [1, 17, 50], 16, 8),
]
# The interpreter's bf16 dot made right, and the reference over gathered slots (test_paged_cascade.py's script too).
INTERPRETER_PROLOGUE = """
import json, sys
import torch
import triton.language as tl
from triton.runtime import interpreter

# Triton's interpreter keeps bfloat16 as uint16 bit patterns and its tl.dot multiplies those (triton-lang/triton
# #11584: bf16 is unsupported there); the GPU multiplies bf16 values into fp32, which converting first reproduces.
_dot = interpreter.InterpreterBuilder.create_dot
def _dot_of_values(self, a, b, d, *rest):
    a, b = (self.cast_impl(x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x for x in (a, b))
    return _dot(self, a, b, d, *rest)
interpreter.InterpreterBuilder.create_dot = _dot_of_values

def reference(q, kp, vp, tables, ctx, bs, scale):
    H, G = q.size(1), q.size(1) // kp.size(1)
    out = []
    for b in range(q.size(0)):
        n = torch.arange(int(ctx[b]))
        slot = tables[b][n // bs] * bs + n % bs
        k, v = (x[slot].float().repeat_interleave(G, 1) for x in (kp, vp))      # [C, H, hd]
        s = torch.einsum("hd,chd->hc", q[b].float(), k) * scale
        out.append(torch.einsum("hc,chd->hd", s.softmax(-1), v))
    return torch.stack(out)
"""
KERNEL_SCRIPT = INTERPRETER_PROLOGUE + """
from services.rollout.engine_torch.paged.attention import paged_decode_attention

dtype = getattr(torch, sys.argv[1])
errors = []
for i, (bs, hd, H, KV, ctxs, tile, parts) in enumerate(json.loads(sys.argv[2])):
    g = torch.Generator().manual_seed(i)
    width = max(-(-c // bs) for c in ctxs) + 2
    nblk = len(ctxs) * width
    kp, vp = (torch.randn(nblk * bs, KV, hd, generator=g).to(dtype) for _ in range(2))
    tables = torch.randperm(nblk, generator=g).view(len(ctxs), width)
    ctx = torch.tensor(ctxs)
    # Entries past a row's context are never read: a block id no pool has would fault there.
    past = torch.arange(width)[None, :] >= (ctx[:, None] + bs - 1) // bs
    tables = tables.masked_fill(past, 10 ** 12)
    q = torch.randn(len(ctxs), H, hd, generator=g).to(dtype)
    got = paged_decode_attention(q, kp, vp, tables, ctx, bs, hd ** -0.5, tile=tile, partitions=parts)
    assert got.dtype == dtype and got.shape == q.shape
    want = reference(q, kp, vp, tables, ctx, bs, hd ** -0.5)
    # Beyond the output's own rounding to dtype (half an ulp):
    errors.append(((got.float() - want).abs() - torch.finfo(dtype).eps / 2 * want.abs()).max().item())
print(json.dumps(errors))
"""


@pytest.mark.parametrize("dtype,tolerance", [("float32", 1e-5), ("bfloat16", 1e-2)])
def test_the_paged_decode_kernel_equals_attention_over_gathered_slots_for_every_tile_and_split(dtype, tolerance):
    pytest.importorskip("triton")
    r = run_interpreted(KERNEL_SCRIPT, dtype, json.dumps(KERNEL_CASES))
    assert r.returncode == 0, r.stderr[-3000:]
    errors = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(errors) == len(KERNEL_CASES)
    assert max(errors) < tolerance, list(zip(KERNEL_CASES, errors))


def test_partitions_and_tiles_follow_host_shapes_only():
    from services.rollout.engine_torch.paged.attention import num_partitions, tile_tokens
    assert (tile_tokens(16, 64), tile_tokens(16, 128), tile_tokens(32, 128), tile_tokens(256, 64)) == (128, 64, 64, 256)
    # Qwen2.5-0.5B (2 kv heads) with 1,280-token tables on 132 SMs: 8 rows split 8 ways (10 would leave partitions
    # under 128 tokens), 64 rows 4, 128 rows 2; 256 rows fill the GPU unsplit.
    assert [num_partitions(b, 2, 1280) for b in (8, 64, 128, 256, 512)] == [8, 4, 2, 1, 1]
    assert num_partitions(1, 2, 100) == 1                      # shorter than one partition's minimum
    assert num_partitions(6, 2, 21 * 16) == 2                  # KERNEL_CASES' auto case splits
    assert num_partitions(1, 1, 10 ** 6) == 32                 # capped
    assert all(p & (p - 1) == 0 for b in range(1, 600, 7) for w in (16, 300, 5000) for p in [num_partitions(b, 2, w)])
