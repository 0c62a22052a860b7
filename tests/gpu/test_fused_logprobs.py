"""GPU tests of the fused LM head (Triton kernels) against the plain fp32 log-softmax, and of a CUDA
TrainActor step with the fused head against one without it. Skipped without CUDA.

bf16 tolerances (stated, measured on an H200): log-prob and entropy max |diff| < 1e-4 (the same bf16
logits, fp32 softmax math in both); gradients within 3% relative norm (the logit gradient is rounded to
bf16 before the two head matmuls, which autograd's bf16 path also does, at other points). fp32 on the
GPU: values within 2e-5, gradients within 1e-4 relative (accumulation order of other GEMM shapes).

    PYTHONPATH=.:protos python -m pytest -q tests/gpu/test_fused_logprobs.py -s
"""

from __future__ import annotations

import pytest
import torch

from services.common.config import load_config
from services.common.tensors.weights import named_weights
from services.common.tensors import fused
from services.trainer.config import TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.testing import make_tiny_model, random_samples
from services.trainer.types import ActorLoss

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(fused.triton is None, reason="needs Triton")]


def plain_head(hidden, weight, targets, temperature):
    logp_all = torch.log_softmax((hidden @ weight.t()).float() / temperature, -1)
    return logp_all.gather(1, targets.unsqueeze(-1)).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


@pytest.mark.parametrize("dtype,temperature", [(torch.bfloat16, 1.0), (torch.bfloat16, 0.7), (torch.float32, 1.0)])
def test_triton_head_matches_the_plain_path_at_qwen_vocab_size(dtype, temperature):
    g = torch.Generator(device="cuda").manual_seed(0)
    N, d, V = 1024, 896, 151936
    hidden = (torch.randn(N, d, device="cuda", generator=g) * 2).to(dtype).requires_grad_()
    weight = (torch.randn(V, d, device="cuda", generator=g) * 0.05).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (N,), device="cuda", generator=g)
    gl, ge = torch.randn(N, device="cuda", generator=g), torch.randn(N, device="cuda", generator=g)
    out = []
    for fn in (plain_head, fused.head_logprobs):
        logp, ent = fn(hidden, weight, targets, temperature)
        dh, dw = torch.autograd.grad((logp * gl).sum() + (ent * ge).sum(), (hidden, weight))
        out.append((logp, ent, dh, dw))
    (lp, ep, hp, wp), (lf, ef, hf, wf) = out
    value_tol, grad_tol = (1e-4, 3e-2) if dtype == torch.bfloat16 else (2e-5, 1e-4)
    print(f"\n{dtype} T={temperature}: logp {float((lf - lp).abs().max()):.2e} entropy {float((ef - ep).abs().max()):.2e}"
          f" d_hidden {rel(hf, hp):.2e} d_weight {rel(wf, wp):.2e}")
    assert float((lf - lp).abs().max()) < value_tol and float((ef - ep).abs().max()) < value_tol
    assert rel(hf, hp) < grad_tol and rel(wf, wp) < grad_tol


def test_a_cuda_step_with_the_fused_head_equals_the_plain_one(tmp_path):
    path = make_tiny_model(tmp_path / "m", vocab_size=300)
    engines = [TrainerEngine(load_config(TrainerSettings, data={
        "model": {"path": path, "device": "cuda"},
        "actor": {"lr": 1e-3, "fused_logprobs": on, "compile": False, "micro_batch_token_budget": 40}}))
        for on in (False, True)]
    assert [e.rank.fused_logprobs for e in engines] == [False, True]
    samples = random_samples(8, vocab_size=300, seed=1)
    loss = ActorLoss(mini_batch_size=4, entropy_coef=0.01)
    mp, mf = (e.train_actor(samples, loss) for e in engines)
    for key in ("pg_loss", "entropy", "grad_norm", "loss"):
        assert mf[key] == pytest.approx(mp[key], abs=1e-5, rel=1e-5), key
    wp, wf = (named_weights(e.rank.actor.module) for e in engines)
    assert max((wp[k] - wf[k]).abs().max().item() for k in wp) < 1e-5
    for e in engines:
        e.close()


def test_packed_rows_on_cuda_varlen_attention_equal_padded_rows(tmp_path):
    """Remove padding on the GPU: torch's varlen flash attention over packed rows (bf16) against SDPA over padded
    rows, within 5e-2 (bf16 activations through other kernels)."""
    from services.common.tensors.modeling import load_causal_lm
    from services.common.tensors.packing import enable_packing, varlen_attn

    if varlen_attn is None:
        pytest.skip("torch has no torch.nn.attention.varlen")
    path = make_tiny_model(tmp_path / "m", vocab_size=300)
    model = load_causal_lm(path, device="cuda", dtype="bfloat16", trainable=True)
    enable_packing(model, "test")
    fused.enable_fused_head(model)
    samples = random_samples(9, vocab_size=300, seed=3, max_prompt=20, max_response=30)
    prompts, responses = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
    out = []
    for packed in (False, True):
        model.zero_grad()
        logp, mask, ent = fused.sequence_logprobs(model, prompts, responses, pad_id=0, device=torch.device("cuda"),
                                                  packed=packed, fused=True)
        (logp.sum() + 0.1 * ent.sum()).backward()
        out.append((logp.detach(), ent.detach(), torch.cat([p.grad.flatten().float() for p in model.parameters()])))
    (la, ea, ga), (lb, eb, gb) = out
    print(f"\npacked vs padded bf16: logp {float((la - lb).abs().max()):.2e} grad rel {rel(gb, ga):.2e}")
    assert float((la - lb).abs().max()) < 5e-2 and float((ea - eb).abs().max()) < 5e-2
    assert rel(gb, ga) < 5e-2


def test_a_cuda_step_packed_equals_padded(tmp_path):
    path = make_tiny_model(tmp_path / "m", vocab_size=300)
    samples = random_samples(8, vocab_size=300, seed=4, max_prompt=20, max_response=30)
    metrics = []
    for packed in (False, True):
        e = TrainerEngine(load_config(TrainerSettings, data={"model": {"path": path, "device": "cuda", "dtype": "bfloat16"},
                                                            "actor": {"lr": 1e-3, "compile": False, "shuffle": False,
                                                                      "use_remove_padding": packed,
                                                                      "micro_batch_token_budget": 120}}))
        assert e.rank.layout.packed is packed and e.rank.fused_logprobs
        metrics.append(e.train_actor(samples, ActorLoss()))
        e.close()
    for key in ("pg_loss", "entropy", "grad_norm"):
        assert metrics[1][key] == pytest.approx(metrics[0][key], rel=3e-2, abs=1e-2), key


def test_packed_rows_under_fp32_master_weights_take_the_varlen_kernel(tmp_path, monkeypatch):
    """With fp32 master weights and bf16 autocast (the trainer's default for a bf16 model) rotary embeddings hand
    the attention fp32 queries and keys: packed rows must still run the varlen kernel in bf16 (as SDPA does
    under autocast), never the per-sequence fallback, which syncs with the host at every layer."""
    from services.common.tensors import packing

    if packing.varlen_attn is None:
        pytest.skip("torch has no torch.nn.attention.varlen")
    calls = {"varlen": 0}
    real = packing._varlen

    def counted(q, k, v, packed, scale):
        calls["varlen"] += 1
        assert q.dtype == k.dtype == v.dtype == torch.bfloat16
        return real(q, k, v, packed, scale)

    monkeypatch.setattr(packing, "_varlen", counted)
    monkeypatch.setattr(packing.torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: pytest.fail("per-sequence SDPA fallback ran"))
    path = make_tiny_model(tmp_path / "m", vocab_size=300)
    e = TrainerEngine(load_config(TrainerSettings, data={"model": {"path": path, "device": "cuda", "dtype": "bfloat16"},
                                                        "actor": {"lr": 1e-3, "compile": False,
                                                                  "use_remove_padding": True}}))
    assert (e.rank.param_dtype, e.rank.compute_dtype, e.rank.layout.packed) == ("float32", "bfloat16", True)
    samples = random_samples(6, vocab_size=300, seed=5, max_prompt=20, max_response=30)
    e.compute_logprobs([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    metrics = e.train_actor(samples, ActorLoss())
    e.close()
    assert calls["varlen"] > 0 and metrics["grad_norm"] > 0
