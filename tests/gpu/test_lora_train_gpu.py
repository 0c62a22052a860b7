"""GPU tests of the trainer's LoRA layer ops (services/trainer/model/lora_linear.py, lora_group.py) at the 1.5B
MLP shape: values and gradients of the unfused nn.Linear + addmm formula they replaced (bf16 rounding), no GEMM over
the frozen weight's gradient under torch.compile. Skipped without CUDA. (Which is faster is a benchmark's question,
not a test's: `LORA_VARIANTS=full,lora,lora_ungrouped,lora_addmm bench/gpu_session.sh loratrain`.)"""

from __future__ import annotations

import pytest
import torch

from services.trainer.model.lora_group import grouped_linear
from services.trainer.model.lora_linear import adapted_linear
from tests.unit.test_lora_train_work import GEMMS, gemm_mkn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOKENS, D_IN, D_OUT, RANK, SCALE = 16384, 1536, 8960, 16, 2.0       # gate_proj of Qwen2.5-1.5B, 8 x 2,048 tokens


def operands(seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(TOKENS, D_IN, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(D_OUT, D_IN, device="cuda", generator=g) * D_IN ** -0.5).bfloat16()
    a = (torch.randn(RANK, D_IN, device="cuda", generator=g) * D_IN ** -0.5).requires_grad_()   # fp32 masters
    b = (torch.randn(D_OUT, RANK, device="cuda", generator=g) * 0.01).requires_grad_()
    return x, w, a, b


def unfused(x, w, a, b):
    """What the trainer ran before: base linear, A, then addmm with the base output as C."""
    res = torch.nn.functional.linear(x, w)
    z = torch.nn.functional.linear(x, a)
    return torch.addmm(res, z.to(res.dtype), b.to(res.dtype).t(), alpha=SCALE)


def fused(x, w, a, b):
    return adapted_linear(x, w, None, a, b, SCALE)


def step(fn, x, w, a, b, dy):
    x.grad = a.grad = b.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = fn(x, w, a, b)
    y.backward(dy)
    return y


def test_the_layer_op_matches_the_unfused_formula_in_values_and_gradients():
    x, w, a, b = operands()
    dy = torch.randn(TOKENS, D_OUT, device="cuda").bfloat16()
    ref = step(unfused, x, w, a, b, dy).float()
    ref_grads = [t.grad.float().clone() for t in (x, a, b)]
    out = step(fused, x, w, a, b, dy).float()
    assert (out - ref).abs().max() <= 2e-2 * ref.abs().max()
    for got, want in zip((x.grad, a.grad, b.grad), ref_grads):
        assert (got.float() - want).abs().max() <= 2e-2 * want.abs().max()


def test_compiled_backward_forms_no_gradient_of_the_frozen_weight():
    from torch.profiler import ProfilerActivity, profile

    x, w, a, b = operands(1)
    dy = torch.randn(TOKENS, D_OUT, device="cuda").bfloat16()
    compiled = torch.compile(fused)
    step(compiled, x, w, a, b, dy)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step(compiled, x, w, a, b, dy)
        torch.cuda.synchronize()
    gemms = [gemm_mkn(e.name, e.input_shapes) for e in prof.events() if e.name in GEMMS]
    assert (TOKENS, D_IN, D_OUT) in gemms                  # the profiler sees the op's GEMMs (its base forward)
    weight_grads = [g for g in gemms if g[1] == TOKENS and {g[0], g[2]} == {D_OUT, D_IN}]
    assert weight_grads == [] and w.grad is None and a.grad is not None and b.grad is not None


@pytest.mark.parametrize("laid_out", ["one_storage", "apart"])
def test_the_group_op_matches_the_unfused_formula_for_gate_and_up(laid_out):
    (x, w_gate, a_gate, b_gate), (_, w_up, a_up, b_up) = operands(2), operands(3)
    if laid_out == "one_storage":           # as apply_lora lays a group's base weights out: one base GEMM for both
        w_gate, w_up = torch.cat([w_gate, w_up]).split(D_OUT)
    dys = [torch.randn(TOKENS, D_OUT, device="cuda").bfloat16() for _ in range(2)]
    params = (x, a_gate, b_gate, a_up, b_up)

    def run(fn):
        for t in params:
            t.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ys = fn()
        torch.autograd.backward(ys, dys)
        return [y.float() for y in ys], [t.grad.float().clone() for t in params]

    ref, ref_grads = run(lambda: [unfused(x, w_gate, a_gate, b_gate), unfused(x, w_up, a_up, b_up)])
    out, grads = run(lambda: grouped_linear(x, [w_gate, w_up], [None, None], [a_gate, a_up], [b_gate, b_up],
                                            [SCALE, SCALE]))
    for got, want in zip(out + grads, ref + ref_grads):
        assert (got - want).abs().max() <= 2e-2 * want.abs().max()
    assert a_gate.grad.dtype == b_up.grad.dtype == torch.float32
