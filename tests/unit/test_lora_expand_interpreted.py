"""The decode step's LoRA kernels (services/rollout/engine_torch/lora_expand.py: meshrl::lora_expand and
meshrl::lora_swiglu) in Triton's CPU interpreter: each equals the torch ops' arithmetic over rows of several adapter
slots and of the base, and the grouped decode step that runs them decodes a batch mixing two adapters of different
ranks and base rows as the eager per-projection loop does. tests/gpu/test_lora_expand_gpu.py runs them on CUDA."""

from __future__ import annotations

import textwrap

import pytest

from tests.interpreted import assert_printed_ok, run_interpreted


def test_the_kernels_equal_the_masked_expand_and_the_swiglu_in_the_interpreter():
    pytest.importorskip("triton")
    script = textwrap.dedent("""
        import torch
        import torch.nn.functional as F
        from services.rollout.engine_torch import lora_expand

        def case(sizes, adapted, rows, rank, slots_n, seed):
            g = torch.Generator().manual_seed(seed)
            W, O, k = slots_n * rank, sum(sizes), sum(adapted)
            y, B = torch.randn(rows, O + k * W, generator=g), torch.zeros(O, k * W)
            starts, row, j = [], 0, 0
            for size, on in zip(sizes, adapted):
                starts.append(j * W if on else -1)
                if on:
                    B[row:row + size, j * W + rank:(j + 1) * W] = torch.randn(size, W - rank, generator=g)
                    j += 1
                row += size
            slots = torch.zeros(rows + 3, dtype=torch.long)
            slots[:rows] = torch.randint(0, slots_n, (rows,), generator=g)
            column_slot = (torch.arange(W) // rank).repeat(k)
            mask = (slots[:rows, None] == column_slot).float()
            want = y[:, :O] + (y[:, O:] * mask) @ B.t()
            return (y, B, slots, sizes, starts, W, rank), want

        for seed, (sizes, adapted, rank, rows) in enumerate([([64, 32, 32], [1, 1, 1], 16, 5),
                                                             ([64, 32, 32], [0, 1, 0], 8, 40),
                                                             ([96], [1], 12, 17), ([128, 128], [1, 1], 32, 1)]):
            args, want = case(sizes, adapted, rows, rank, 5, seed)
            got = lora_expand.lora_expand(*args)
            assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (sizes, adapted, rank, rows)
            base = args[2][:rows] == 0
            assert torch.equal(got[base], args[0][base, :sum(sizes)])
        for seed, (adapted, rank, rows) in enumerate([([1, 1], 16, 9), ([1, 0], 8, 33)]):
            args, want = case([64, 64], adapted, rows, rank, 5, 10 + seed)
            got = lora_expand.lora_swiglu(*args)
            assert torch.allclose(got, F.silu(want[:, :64]) * want[:, 64:], atol=1e-4, rtol=1e-4), (adapted, rank)
        print("ok")
    """)
    assert_printed_ok(run_interpreted(script, timeout=300))


@pytest.mark.slow
def test_the_grouped_step_through_the_kernels_decodes_what_the_eager_loop_decodes_in_the_interpreter():
    pytest.importorskip("triton")
    script = textwrap.dedent("""
        from services.rollout.engine_torch import lora_expand
        lora_expand.available = lambda device, sizes: lora_expand.block_n(sizes) is not None   # CPU tensors
        from tests.unit.test_lora_grouped_decode import lora_engine
        from tests.unit.test_rollout_lora import assert_same, batch, greedy, trained_adapter
        from services.rollout.engine_torch.engine import _Job
        from services.rollout.testing import make_tiny_model
        import sys, tempfile
        model_dir = make_tiny_model(tempfile.mkdtemp())
        adapters = {"a": trained_adapter(model_dir, seed=21, rank=4, alpha=8.0),
                    "b": trained_adapter(model_dir, seed=22, rank=8, alpha=32.0)}
        graph, eager = lora_engine(model_dir, adapters, graph=True), lora_engine(model_dir, adapters, graph=False)
        step = graph._graph_decoder
        assert step._by_kernel and not step._by_torch and step._silu
        requests = [batch(greedy("a", n=2)), batch(greedy("")), batch(greedy("b"))]
        got = graph._generate_jobs([_Job(r, graph.check_batch(r), None) for r in requests])
        want = eager._generate_jobs([_Job(r, eager.check_batch(r), None) for r in requests])
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)
        print("ok")
    """)
    assert_printed_ok(run_interpreted(script, timeout=600))
