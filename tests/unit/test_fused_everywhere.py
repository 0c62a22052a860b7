"""The fused chunked log-prob head is the one path of every pass: vocab-parallel under TP (two gloo ranks), chunked
on the last pipeline stage, in DPO and ComputeLogProbs; each equals the full-logits math (fp32 CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from services.common.tensors import fused
from services.common.config import load_config
from services.trainer.config import TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.updates.losses import logprobs_from_logits
from services.trainer.parallel.pipeline import stage_logprobs
from services.trainer.testing import make_tiny_model, random_samples
from services.trainer.types import DPOLoss, PreferencePair

N, D, V = 37, 16, 48


def full_logits_reference(hidden, weight, targets, temperature):
    """logp, entropy and their gradients through full fp32 [N, V] logits."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp_all = torch.log_softmax((h @ w.t()).float() / temperature, -1)
    logp = logp_all.gather(1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    (logp.sum() + 0.5 * ent.sum()).backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


def _vocab_parallel_rank(rank: int, init: str, out: dict):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from services.common.tensors.vocab_parallel import vocab_parallel_logprobs

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        hidden, weight, targets = torch.randn(N, D), torch.randn(V, D), torch.randint(0, V, (N,))
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        w = torch.nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)]))
        h = hidden.clone().requires_grad_()
        logp, ent = vocab_parallel_logprobs(h, w, targets, 0.8)
        (logp.sum() + 0.5 * ent.sum()).backward()
        out[rank] = (logp.detach(), ent.detach(), h.grad, w.grad.full_tensor())
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_the_vocab_parallel_head_over_two_ranks_equals_full_logits(tmp_path):
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_vocab_parallel_rank, args=(f"file://{tmp_path / 'rdv'}", out), nprocs=2)
        results = dict(out)
    torch.manual_seed(0)
    hidden, weight, targets = torch.randn(N, D), torch.randn(V, D), torch.randint(0, V, (N,))
    want = full_logits_reference(hidden, weight, targets, 0.8)
    for rank in (0, 1):
        for got, ref, name in zip(results[rank], want, ("logp", "entropy", "grad hidden", "grad weight")):
            assert torch.allclose(got, ref, atol=1e-5), (rank, name)


def test_the_chunked_head_never_holds_more_than_a_chunk_and_equals_full_logits(monkeypatch):
    torch.manual_seed(1)
    hidden, weight, targets = torch.randn(N, D), torch.randn(V, D), torch.randint(0, V, (N,))
    monkeypatch.setattr(fused, "CHUNK_BYTES", 4 * V * 5)                     # 5 rows per chunk: 8 chunks
    shapes = []
    real_rows_fwd = fused.rows_fwd
    monkeypatch.setattr(fused, "rows_fwd", lambda z, *a: shapes.append(z.shape) or real_rows_fwd(z, *a))
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, ent = fused.head_logprobs(h, w, targets, 0.8)
    (logp.sum() + 0.5 * ent.sum()).backward()
    assert max(s[0] for s in shapes) == 5 and len(shapes) == 8
    for got, ref in zip((logp, ent, h.grad, w.grad), full_logits_reference(hidden, weight, targets, 0.8)):
        assert torch.allclose(got, ref, atol=1e-5)


def test_the_last_pipeline_stage_log_probs_equal_the_full_logits_path():
    torch.manual_seed(2)
    B, L, R = 3, 9, 5
    hidden, weight = torch.randn(B, L, D), torch.randn(V, D)
    positions = torch.randint(0, L, (B, R))
    targets = torch.randint(0, V, (B, R))
    mask = torch.rand(B, R) > 0.3
    logp, ent = stage_logprobs(hidden, weight, positions, targets, mask, 0.7)
    want_logp, want_ent = logprobs_from_logits(hidden @ weight.t(), positions, targets, mask, 0.7)
    assert torch.allclose(logp, want_logp, atol=1e-5) and torch.allclose(ent, want_ent, atol=1e-5)
    assert logp[~mask].abs().max() == 0


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def engine(model_path: str, fused_head: bool) -> TrainerEngine:
    return TrainerEngine(load_config(TrainerSettings, data={"model": {"path": model_path}, "actor": {
        "lr": 1e-3, "shuffle": False, "fused_logprobs": fused_head}}))


def test_compute_logprobs_and_dpo_through_the_fused_head_equal_full_logits(model_path):
    samples = random_samples(6, seed=8)
    prompts, responses = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
    pairs = [PreferencePair(s.prompt_ids, s.response_ids, t.response_ids, -3.0, -4.0)
             for s, t in zip(samples[:3], samples[3:])]
    out = []
    for on in (False, True):
        e = engine(model_path, on)
        assert e.rank.fused_logprobs is on
        out.append((e.compute_logprobs(prompts, responses), e.train_dpo(pairs, DPOLoss(beta=0.1)),
                    e.compute_logprobs(prompts, responses)))
    (lp_a, m_a, after_a), (lp_b, m_b, after_b) = out
    assert max(abs(x - y) for ra, rb in zip(lp_a, lp_b) for x, y in zip(ra, rb)) < 1e-5
    for key in ("loss", "logps/chosen", "logps/rejected", "grad_norm"):
        assert m_a[key] == pytest.approx(m_b[key], abs=1e-5), key
    assert max(abs(x - y) for ra, rb in zip(after_a, after_b) for x, y in zip(ra, rb)) < 1e-5
