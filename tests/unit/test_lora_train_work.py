"""A LoRA actor step does strictly less work than a full one: no GEMM of the step forms a frozen base weight's
gradient (the profiler lists every matmul with its shapes, inside the adapter op too), an adapted layer makes
one pass over each [tokens, features] tensor it needs (no copy or add over its output, no second GEMM over it), and
adapted layers that read one input (q/k/v, gate/up) read it once for all their adapters."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from services.common.config import load_config
from services.trainer.config import LoraSection, TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.model import lora_linear
from services.trainer.model.lora import ADAPTER, apply_lora
from services.trainer.testing import make_tiny_model
from services.trainer.types import ActorLoss, TrainSample

GEMMS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm")
PASSES = ("aten::add", "aten::add_", "aten::mul", "aten::mul_", "aten::copy_", "aten::clone", "aten::sum")
# 3 sequences of 5 + 12 tokens: 51 tokens (padded rows on CPU), 36 response tokens through the fused head; neither
# is a model dimension, so a GEMM over either is one that sums over tokens.
BATCH, PROMPT, RESPONSE = 3, 5, 12
VOCAB = 96
RANK = 4


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("lora_work") / "model", vocab_size=VOCAB)


def gemm_mkn(name: str, shapes: list) -> tuple[int, int, int]:
    a, b = (shapes[0], shapes[1]) if name in ("aten::mm", "aten::bmm") else (shapes[1], shapes[2])
    return a[-2], a[-1], b[-1]


def profiled(fn) -> list[tuple[str, list]]:
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return [(e.name, e.input_shapes) for e in prof.events()]


def weight_grad_gemms(events, frozen: dict[str, torch.Size], tokens: set[int]) -> list:
    """GEMMs that sum over tokens into a frozen weight's shape ([out, in] or its transpose): a weight gradient."""
    shapes = {t for s in frozen.values() if len(s) == 2 for t in (tuple(s), tuple(s)[::-1])}
    hits = []
    for name, s in events:
        if name in GEMMS:
            m, k, n = gemm_mkn(name, s)
            if k in tokens and (m, n) in shapes:
                hits.append((name, s))
    return hits


def one_step(model_path: str, lora: bool, compile: bool):
    actor = {"lr": 1e-3, "activation_checkpointing": "full", "compile": compile, "warmup": False,
             "micro_batch_token_budget": BATCH * (PROMPT + RESPONSE)}
    if lora:
        actor["lora"] = {"rank": RANK, "alpha": 2 * RANK}
    e = TrainerEngine(load_config(TrainerSettings, data={"model": {"path": model_path, "dtype": "bfloat16"},
                                                         "actor": actor}))
    g = torch.Generator().manual_seed(0)
    samples = [TrainSample(prompt_ids=torch.randint(3, VOCAB, (PROMPT,), generator=g).tolist(),
                           response_ids=torch.randint(3, VOCAB, (RESPONSE,), generator=g).tolist(),
                           advantages=torch.randn(RESPONSE, generator=g).tolist(), old_logprobs=[0.0] * RESPONSE,
                           ref_logprobs=[]) for _ in range(BATCH)]
    step = lambda: e.train_actor(samples, ActorLoss(mini_batch_size=BATCH))     # noqa: E731
    if compile:
        step()                                                                   # compiles outside the profile
    return e, profiled(step)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_a_lora_step_runs_no_gemm_that_forms_a_frozen_base_weights_gradient(model_path, compile):
    tokens = {BATCH * (PROMPT + RESPONSE), BATCH * RESPONSE}
    if not compile:            # the detector sees a full step's weight gradients: each linear of both blocks, the head
        full, full_events = one_step(model_path, lora=False, compile=False)
        weights = {n: p.shape for n, p in full.rank.actor.module.named_parameters()}
        assert len(weight_grad_gemms(full_events, weights, tokens)) >= 2 * 7 + 1
    e, events = one_step(model_path, lora=True, compile=compile)
    frozen = {n: p for n, p in e.rank.actor.module.named_parameters() if ".lora_" not in n}
    assert weight_grad_gemms(events, {n: p.shape for n, p in frozen.items()}, tokens) == []
    assert all(p.grad is None for p in frozen.values())
    # The adapters did train: one gradient GEMM over the tokens for each A and B of o_proj and down_proj, and for a
    # group's A stacked (q/k/v [3r, in], gate/up [2r, in]: x read once) and its B's block-diagonal ([O, R]: every
    # member's B in one) (compiled: inside the compiled backward's op, which the profiler sees as it would see the
    # base's).
    adapters = {n: p.shape for n, p in e.rank.actor.module.named_parameters() if ".lora_" in n and (
        ".o_proj." in n or ".down_proj." in n)}
    config = e.rank.actor.module.config
    hidden, head = config.hidden_size, config.hidden_size // config.num_attention_heads
    qkv_out = hidden + 2 * config.num_key_value_heads * head
    stacked = {"qkv": torch.Size([3 * RANK, hidden]), "gate_up": torch.Size([2 * RANK, hidden]),
               "qkv_b": torch.Size([qkv_out, 3 * RANK]), "gate_up_b": torch.Size([2 * config.intermediate_size,
                                                                                   2 * RANK])}
    assert len(weight_grad_gemms(events, adapters | stacked, tokens)) == 2 * (4 + 4)
    groups = [n for n, _ in events if n in ("meshrl::lora_group_backward", "_EagerGroupBackward")]
    assert len(groups) == 2 * 2                                       # one backward for each group of each block
    # A group's z = x A^T: one GEMM over its input in forward and one in the checkpoint's recompute, none in
    # backward (the op kept it).
    shrinks = [gemm_mkn(n, s) for n, s in events if n in GEMMS and gemm_mkn(n, s)[1:] in ((hidden, 3 * RANK),
                                                                                           (hidden, 2 * RANK))]
    assert len(shrinks) == 2 * 2 * 2 and {m for m, _, _ in shrinks} <= tokens


@pytest.mark.parametrize("base_first", [True, False], ids=["cpu_order", "cuda_order"])
@pytest.mark.parametrize("bias", [False, True])
def test_an_adapted_layer_makes_one_pass_over_each_activation_and_its_gradient(bias, base_first, monkeypatch):
    monkeypatch.setattr(lora_linear, "base_first", lambda x: base_first)
    T, d_in, d_out, r = 37, 48, 80, 4
    torch.manual_seed(0)
    model = nn.Module()
    model.q_proj = nn.Linear(d_in, d_out, bias=bias).to(torch.bfloat16)
    apply_lora(model, LoraSection(rank=r, alpha=2 * r, target_modules=["q_proj"]), adapter_dtype=torch.float32)
    layer = model.q_proj
    a, b_lora = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight          # fp32 master adapters
    nn.init.normal_(b_lora)                                                          # B = 0 would hide the path
    x = torch.randn(T, d_in, dtype=torch.bfloat16, requires_grad=True)

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        y.backward(torch.ones_like(y))
        return y

    events = profiled(run)
    gemms = [gemm_mkn(n, s) for n, s in events if n in GEMMS]
    # Forward: z = x A^T, the adapter's part and the base's. Backward: z again, dz, dB, dA, dz A and dy W (one of each
    # pair adds onto the other).
    assert sorted(gemms) == sorted([(T, d_in, r), (T, r, d_out), (T, d_in, d_out), (T, d_in, r),
                                    (T, d_out, r), (d_out, T, r), (r, T, d_in), (T, r, d_in), (T, d_out, d_in)])
    # One GEMM of each pair accumulates onto the other's output in place (which one: lora_linear.base_first).
    small, big_k = (r, r) if base_first else (d_in, d_out)
    onto = [("aten::addmm_", [[T, d_out], [T, small], [small, d_out], [], []]),
            ("aten::addmm_", [[T, d_in], [T, big_k], [big_k, d_in], [], []])]
    assert all(e in events for e in onto)
    # Outside the GEMMs nothing reads or writes a [tokens, features] tensor (a bias's broadcast copy inside addmm
    # aside): no separate scale, add or copy of the output or of x's gradient.
    big = {(T, d_in), (T, d_out)}
    passes = [(n, s) for n, s in events if n in PASSES and any(tuple(t) in big for t in s)]
    assert passes == ([("aten::copy_", [[T, d_out], [T, d_out], []])] if bias else [])
    assert layer.base_layer.weight.grad is None and a.grad.dtype == b_lora.grad.dtype == torch.float32
    # The values of the unfused formula (fp32 reference of the bf16 operands).
    xf, wf = x.detach().float(), layer.base_layer.weight.float()
    bf = lambda t: t.detach().to(torch.bfloat16).float()                            # noqa: E731
    ref = xf @ wf.t() + layer.scaling[ADAPTER] * (xf @ bf(a).t()) @ bf(b_lora).t()
    if bias:
        ref = ref + layer.base_layer.bias.float()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert (y.float() - ref).abs().max() <= 1e-2 * ref.abs().max()


class Siblings(nn.Module):
    """q/k/v on one input, as an attention forward calls them."""

    def __init__(self, d_in: int, outs: tuple[int, ...], bias: bool):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d_in, o, bias=bias).to(torch.bfloat16) for o in outs)

    def forward(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


def adapted_siblings(d_in: int, outs: tuple[int, ...], r: int, bias: bool):
    torch.manual_seed(0)
    model = nn.Module()
    model.attn = Siblings(d_in, outs, bias)
    apply_lora(model, LoraSection(rank=r, alpha=2 * r, target_modules=["q_proj", "k_proj", "v_proj"]),
               adapter_dtype=torch.float32)
    return model, [model.attn.q_proj, model.attn.k_proj, model.attn.v_proj]


def forward_backward(attn: nn.Module, x: torch.Tensor):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ys = attn(x)
    torch.autograd.backward(ys, [torch.ones_like(y) for y in ys])
    return ys


def assert_unfused_values(attn: nn.Module, layers: list[nn.Module], x: torch.Tensor, bias: bool) -> None:
    """The values of the unfused formula (fp32 reference of the bf16 operands), and nothing left on x."""
    xf = x.detach().float()
    bf = lambda t: t.detach().to(torch.bfloat16).float()                            # noqa: E731
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ys = attn(x)
    for layer, y in zip(layers, ys):
        ref = xf @ layer.base_layer.weight.float().t() + layer.scaling[ADAPTER] * (
            xf @ bf(layer.lora_A[ADAPTER].weight).t()) @ bf(layer.lora_B[ADAPTER].weight).t()
        if bias:
            ref = ref + layer.base_layer.bias.float()
        assert (y.float() - ref).abs().max() <= 1e-2 * ref.abs().max()
    assert [v for k, v in vars(x).items() if k.startswith("_meshrl_lora")] == [None, None]


@pytest.mark.parametrize("laid_out", ["one_storage", "apart"])
@pytest.mark.parametrize("base_first", [True, False], ids=["cpu_order", "cuda_order"])
@pytest.mark.parametrize("bias", [False, True])
def test_a_group_of_adapted_layers_reads_its_input_once_for_all_their_adapters(bias, base_first, laid_out,
                                                                                monkeypatch):
    monkeypatch.setattr(lora_linear, "base_first", lambda x: base_first)
    T, d_in, outs, r = 37, 48, (80, 24, 24), 4
    R, O = 3 * r, sum(outs)
    model, layers = adapted_siblings(d_in, outs, r, bias)
    bases = [layer.base_layer.weight for layer in layers]
    # apply_lora put the three base weights one after another in one storage (views: the group's one base GEMM).
    assert len({w.untyped_storage().data_ptr() for w in bases}) == 1
    assert [w.storage_offset() for w in bases] == [0, outs[0] * d_in, (outs[0] + outs[1]) * d_in]
    if laid_out == "apart":                 # a weight replaced since: the op runs each member's base GEMM
        layers[1].base_layer.weight = nn.Parameter(bases[1].detach().clone(), requires_grad=False)
    for layer in layers:
        nn.init.normal_(layer.lora_B[ADAPTER].weight)                               # B = 0 would hide the path
    x = torch.randn(T, d_in, dtype=torch.bfloat16, requires_grad=True)
    events = profiled(lambda: forward_backward(model.attn, x))
    gemms = [gemm_mkn(n, s) for n, s in events if n in GEMMS]
    # Forward: one z = x A^T for the three (A stacked, [R, in]), one adapter part for all (the scaled B's as one
    # block-diagonal [O, R]) and the base's. Backward: one dz, one dB (the block-diagonal's), one dA (x read once),
    # one dz A and the base's dy W; z is not recomputed (the op kept it). Base weights apart: a base GEMM per member.
    base_fwd, base_bwd = ([(T, d_in, O)], [(T, O, d_in)]) if laid_out == "one_storage" else (
        [(T, d_in, o) for o in outs], [(T, o, d_in) for o in outs])
    forward = [(T, d_in, R), (T, R, O)] + base_fwd
    backward = [(T, O, R), (O, T, R), (R, T, d_in), (T, R, d_in)] + base_bwd
    assert sorted(gemms) == sorted(forward + backward)
    assert [g for g in gemms if g[:2] == (T, d_in)] == [(T, d_in, R)] + base_fwd
    # The output: one GEMM accumulates onto the other's in place (apart: each member's base onto its columns); x's
    # gradient: one [T, in] product that the rest accumulate onto.
    if laid_out == "apart":
        onto = [[[T, o], [T, d_in], [d_in, o], [], []] for o in outs]
        dx_onto = [[[T, d_in], [T, o], [o, d_in], [], []] for o in outs]
    else:
        onto = [[[T, O], [T, R], [R, O], [], []] if base_first else [[T, O], [T, d_in], [d_in, O], [], []]]
        dx_onto = [[[T, d_in], [T, R], [R, d_in], [], []] if base_first else [[T, d_in], [T, O], [O, d_in], [], []]]
    in_place = [s for n, s in events if n == "aten::addmm_"]
    assert sorted(map(str, in_place)) == sorted(map(str, onto + dx_onto))
    # Outside the GEMMs nothing reads or writes a [tokens, features] tensor but a bias's broadcast copy inside addmm
    # and autograd's own join of the three outputs' gradients into the op's one dy [T, O] (eager; a compiled
    # block's backward writes them into it).
    big = {(T, d_in), (T, O)} | {(T, o) for o in outs}
    passes = [(n, s) for n, s in events if n in PASSES and any(tuple(t) in big for t in s)]
    assert passes == ([("aten::copy_", [[T, O], [T, O], []])] if bias else [])
    assert [s for n, s in events if n == "SplitWithSizesBackward0"] == [[[T, o] for o in outs]]
    assert all(layer.base_layer.weight.grad is None for layer in layers)
    assert_unfused_values(model.attn, layers, x, bias)
