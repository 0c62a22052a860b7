"""GPU tests of the decode step's one-kernel LoRA expand and SwiGLU (services/rollout/engine_torch/lora_expand.py)
against the same arithmetic in fp32 torch: a group's base outputs plus each row's slot's columns of h times its
member's block of B, rows of several slots and of the base (slot 0) in one call, members not adapted, ranks below the
kernel's 16-column chunk and ones that straddle it. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from services.rollout.engine_torch import lora_expand

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def case(sizes, adapted, rows, rank, slots_n, dtype, seed=0):
    """y [rows, O + k * W], B [O, k * W] block-diagonal over the adapted members, slots [rows + 3] (the rest 0)."""
    g = torch.Generator().manual_seed(seed)
    W, O, k = slots_n * rank, sum(sizes), sum(adapted)
    y = torch.randn(rows, O + k * W, generator=g)
    B = torch.zeros(O, k * W)
    starts, row, j = [], 0, 0
    for size, on in zip(sizes, adapted):
        if on:
            B[row:row + size, j * W:(j + 1) * W] = torch.randn(size, W, generator=g)
            B[row:row + size, j * W:j * W + rank] = 0          # slot 0: the base model's columns are zeros
            starts.append(j * W)
            j += 1
        else:
            starts.append(-1)
        row += size
    slots = torch.zeros(rows + 3, dtype=torch.long)
    slots[:rows] = torch.randint(0, slots_n, (rows,), generator=g)
    return [t.cuda() for t in (y.to(dtype), B.to(dtype), slots)] + [starts, W]


def reference(y, B, slots, sizes, W, rank):
    """The torch ops' arithmetic in fp32: y[:, :O] + (h * each row's slot mask) B^T."""
    O, n = sum(sizes), y.shape[0]
    k = B.shape[1] // W
    column_slot = (torch.arange(W, device=y.device) // rank).repeat(k)
    mask = (slots[:n, None] == column_slot).float()
    return y[:, :O].float() + (y[:, O:].float() * mask) @ B.float().t()


@pytest.mark.parametrize("sizes,adapted", [([64, 32, 32], [1, 1, 1]), ([64, 32, 32], [0, 1, 0]),
                                           ([128, 128], [1, 1]), ([96], [1])])
@pytest.mark.parametrize("rank", [16, 8, 12, 32])
@pytest.mark.parametrize("rows", [1, 5, 40, 130])
def test_the_kernel_is_the_masked_expand_added_to_the_base_outputs(sizes, adapted, rank, rows):
    y, B, slots, starts, W = case(sizes, adapted, rows, rank, slots_n=5, dtype=torch.float32)
    assert lora_expand.available(y.device, sizes)
    got = lora_expand.lora_expand(y, B, slots, sizes, starts, W, rank)
    torch.testing.assert_close(got, reference(y, B, slots, sizes, W, rank), atol=1e-4, rtol=1e-4)
    base = slots[:rows] == 0
    assert torch.equal(got[base], y[base, :sum(sizes)])          # base rows: the base output, untouched


def test_bf16_rounds_once_and_stays_within_a_bf16_step():
    sizes, rank = [1536, 256, 256], 16
    y, B, slots, starts, W = case(sizes, [1, 1, 1], 128, rank, slots_n=5, dtype=torch.bfloat16, seed=1)
    got = lora_expand.lora_expand(y, B, slots, sizes, starts, W, rank)
    want = reference(y, B, slots, sizes, W, rank)
    torch.testing.assert_close(got.float(), want, atol=0.05, rtol=1e-2)


def test_a_width_no_column_block_divides_is_left_to_the_torch_ops():
    assert lora_expand.block_n([64, 40]) is None and not lora_expand.available(torch.device("cuda"), [64, 40])
    assert not lora_expand.available(torch.device("cpu"), [64, 32, 32])


def test_captured_in_a_cuda_graph_it_reads_the_slots_by_address():
    sizes, rank = [64, 32, 32], 16
    y, B, slots, starts, W = case(sizes, [1, 1, 1], 8, rank, slots_n=5, dtype=torch.float32, seed=2)
    out = lora_expand.lora_expand(y, B, slots, sizes, starts, W, rank)          # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lora_expand.lora_expand(y, B, slots, sizes, starts, W, rank)
    slots[:8] = torch.tensor([0, 1, 2, 3, 4, 4, 1, 0], device="cuda")
    graph.replay()
    torch.testing.assert_close(out, reference(y, B, slots, sizes, W, rank), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("adapted", [[1, 1], [0, 1]])
@pytest.mark.parametrize("rank", [16, 8])
@pytest.mark.parametrize("rows", [1, 40, 130])
def test_the_swiglu_kernel_is_silu_of_gate_times_up_with_their_deltas(adapted, rank, rows):
    sizes = [128, 128]
    y, B, slots, starts, W = case(sizes, adapted, rows, rank, slots_n=5, dtype=torch.float32, seed=3)
    got = lora_expand.lora_swiglu(y, B, slots, sizes, starts, W, rank)
    full = reference(y, B, slots, sizes, W, rank)
    torch.testing.assert_close(got, torch.nn.functional.silu(full[:, :128]) * full[:, 128:], atol=1e-4, rtol=1e-4)
