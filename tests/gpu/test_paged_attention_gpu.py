"""The compiled paged decode kernel (services/rollout/engine_torch/paged/attention.py) at real shapes on CUDA: every
tile and split-K choice equals attention over the gathered slots, eagerly and replayed from a CUDA graph (the
split-K scratch allocated inside the capture). The interpreter tests (tests/unit/test_paged_kv_attention.py) cover
the same cases small, on CPU; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from services.rollout.engine_torch.paged.attention import num_partitions, paged_decode_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def reference(q, kp, vp, tables, ctx, bs, scale):
    """fp32 attention of each row over its first ctx[b] slots, padded to the longest row and masked."""
    B, H, hd = q.shape
    G = H // kp.size(1)
    n = torch.arange(int(ctx.max()), device=q.device)
    slot = tables.gather(1, (n // bs).expand(B, -1)) * bs + n % bs                   # [B, C]
    k, v = (x[slot].float().repeat_interleave(G, 2) for x in (kp, vp))              # [B, C, H, hd]
    s = torch.einsum("bhd,bchd->bhc", q.float(), k) * scale
    s = s.masked_fill((n[None, :] >= ctx[:, None])[:, None, :], -float("inf"))
    return torch.einsum("bhc,bchd->bhd", s.softmax(-1), v)


def inputs(B, H, KV, hd, bs, longest, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    width = -(-longest // bs)
    nblk = B * width + 1
    kp, vp = (torch.randn(nblk * bs, KV, hd, device="cuda", generator=g, dtype=dtype) for _ in range(2))
    tables = torch.randperm(nblk - 1, device="cuda", generator=g).view(B, width)
    ctx = torch.randint(1, longest + 1, (B,), device="cuda", generator=g)
    ctx[0], ctx[-1] = 1, longest                                                      # the extremes, always
    q = torch.randn(B, H, hd, device="cuda", generator=g, dtype=dtype)
    return q, kp, vp, tables, ctx


@pytest.mark.parametrize("H,KV,hd", [(14, 2, 64), (12, 2, 128)])           # Qwen2.5-0.5B, 1.5B
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("B", [8, 256])
def test_every_tile_and_split_of_the_compiled_kernel_equals_attention_over_gathered_slots(H, KV, hd, bs, B):
    q, kp, vp, tables, ctx = inputs(B, H, KV, hd, bs, 1280, torch.bfloat16)
    want = reference(q, kp, vp, tables, ctx, bs, hd ** -0.5)
    for tile in (None, bs, 128):
        for parts in (None, 1, 3, 16):
            got = paged_decode_attention(q, kp, vp, tables, ctx, bs, hd ** -0.5, tile=tile, partitions=parts)
            err = ((got.float() - want).abs() - 2 ** -8 * want.abs()).max().item()
            assert err < 1e-2, (tile, parts, err)


def test_a_captured_split_k_call_replays_with_new_context_lengths():
    B, H, KV, hd, bs = 8, 14, 2, 64, 16
    q, kp, vp, tables, ctx = inputs(B, H, KV, hd, bs, 2048, torch.bfloat16, seed=1)
    assert num_partitions(B, KV, tables.size(1) * bs, torch.cuda.get_device_properties(0).multi_processor_count) > 1
    paged_decode_attention(q, kp, vp, tables, ctx, bs, hd ** -0.5)                  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(q, kp, vp, tables, ctx, bs, hd ** -0.5)
    for lengths in ([1] * B, [2048] * B, [5, 17, 2000, 128, 129, 1, 700, 2048]):
        ctx.copy_(torch.tensor(lengths))
        graph.replay()
        want = reference(q, kp, vp, tables, ctx, bs, hd ** -0.5)
        assert ((out.float() - want).abs() - 2 ** -8 * want.abs()).max().item() < 1e-2, lengths
