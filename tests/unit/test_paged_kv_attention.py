"""The paged KV cache's Triton decode attention (services/rollout/engine_torch/paged/attention.py), run in Triton's
CPU interpreter: a decode step over block tables equals the torch path (gather + scaled_dot_product_attention)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


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
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{REPO}:{REPO / 'protos'}"}
    r = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if "ok" not in r.stdout and ("interpret" in r.stderr.lower() and "not supported" in r.stderr.lower()):
        pytest.skip(f"this Triton has no CPU interpreter: {r.stderr[-300:]}")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
