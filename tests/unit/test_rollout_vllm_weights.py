"""The vllm engine's weight swap on a stand-in of vLLM's CPU model (fused q/k/v and gate/up, padded
vocabulary, linear weights repacked into kernels and dropped, tied head): no vLLM needed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.rollout.engine_vllm.weights import check_plan, pack_tensors, plan_update, swap_weights, unpack_tensors

H, Q, KV, I, V, V_PADDED = 8, 8, 4, 12, 5, 8


def fake_dispatch(layer, remove_weight: bool) -> None:
    """Like vLLM's dispatch_cpu_unquantized_gemm: packs the weight into a kernel, may drop the tensor."""
    packed = layer.weight.detach().clone()
    layer.cpu_linear = lambda x, weight, bias: F.linear(x, packed, bias)
    if remove_weight:
        layer.weight = nn.Parameter(torch.empty(0), requires_grad=False)


class PackedLinear(nn.Module):
    """vLLM's linear after loading on CPU: an empty weight placeholder and a packed kernel."""

    def __init__(self, out: int, inp: int, bias: bool = False, output_sizes: list[int] | None = None):
        super().__init__()
        self.output_size_per_partition, self.input_size_per_partition = out, inp
        if output_sizes is not None:
            self.output_sizes = output_sizes
        self.weight = nn.Parameter(torch.randn(out, inp), requires_grad=False)
        self.bias = nn.Parameter(torch.randn(out), requires_grad=False) if bias else None
        fake_dispatch(self, remove_weight=True)

    def forward(self, x):
        return self.cpu_linear(x, self.weight, self.bias)


class PaddedEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_embeddings_padded = V_PADDED
        self.weight = nn.Parameter(torch.randn(V_PADDED, H), requires_grad=False)
        fake_dispatch(self, remove_weight=False)


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv_proj = PackedLinear(Q + 2 * KV, H, bias=True, output_sizes=[Q, KV, KV])
        self.o_proj = PackedLinear(H, Q)


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = PackedLinear(2 * I, H)
        self.down_proj = PackedLinear(H, I)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn, self.mlp = Attn(), Mlp()
        self.input_layernorm = nn.Module()
        self.input_layernorm.weight = nn.Parameter(torch.ones(H), requires_grad=False)


class FakeVllmQwen2(nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = PaddedEmbedding()
        self.model.layers = nn.ModuleList([Layer()])
        self.lm_head = PaddedEmbedding()
        self.lm_head.weight = self.model.embed_tokens.weight        # tied, with its own packed kernel
        fake_dispatch(self.lm_head, remove_weight=False)


def hf_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"model.embed_tokens.weight": (V, H),
              "model.layers.0.self_attn.q_proj.weight": (Q, H), "model.layers.0.self_attn.q_proj.bias": (Q,),
              "model.layers.0.self_attn.k_proj.weight": (KV, H), "model.layers.0.self_attn.k_proj.bias": (KV,),
              "model.layers.0.self_attn.v_proj.weight": (KV, H), "model.layers.0.self_attn.v_proj.bias": (KV,),
              "model.layers.0.self_attn.o_proj.weight": (H, Q),
              "model.layers.0.mlp.gate_proj.weight": (I, H), "model.layers.0.mlp.up_proj.weight": (I, H),
              "model.layers.0.mlp.down_proj.weight": (H, I), "model.layers.0.input_layernorm.weight": (H,)}
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def outputs(model: FakeVllmQwen2, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """What every kernel and parameter computes now (the model's observable state)."""
    layer = model.model.layers[0]
    return {"qkv": layer.self_attn.qkv_proj(x), "o": layer.self_attn.o_proj(x),
            "gate_up": layer.mlp.gate_up_proj(x), "down": layer.mlp.down_proj(torch.ones(1, I)),
            "logits": model.lm_head.cpu_linear(x, model.lm_head.weight, None),
            "embed": model.model.embed_tokens.weight.clone(), "norm": layer.input_layernorm.weight.clone()}


def test_plan_maps_qkv_and_gate_up_parts_in_vllm_stacking_order():
    targets = plan_update(FakeVllmQwen2(), hf_state(0))
    qkv = targets["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.parts == [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    assert targets["model.layers.0.mlp.gate_up_proj.weight"].parts == ["model.layers.0.mlp.gate_proj.weight",
                                                                        "model.layers.0.mlp.up_proj.weight"]
    assert targets["model.layers.0.self_attn.o_proj.weight"].parts == ["model.layers.0.self_attn.o_proj.weight"]


def test_swap_rebuilds_packed_kernels_with_the_new_fused_weights_and_keeps_vocab_padding():
    model = FakeVllmQwen2()
    padding_before = model.model.embed_tokens.weight[V:].clone()
    new = hf_state(1)
    done = swap_weights(model, new, dispatch=fake_dispatch)
    x = torch.randn(3, H)
    out = outputs(model, x)
    p = "model.layers.0."
    qkv_w = torch.cat([new[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
    qkv_b = torch.cat([new[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
    torch.testing.assert_close(out["qkv"], F.linear(x, qkv_w, qkv_b))
    torch.testing.assert_close(out["gate_up"], F.linear(x, torch.cat([new[p + "mlp.gate_proj.weight"],
                                                                      new[p + "mlp.up_proj.weight"]])))
    torch.testing.assert_close(out["o"], F.linear(x, new[p + "self_attn.o_proj.weight"]))
    torch.testing.assert_close(out["embed"][:V], new["model.embed_tokens.weight"])
    torch.testing.assert_close(out["embed"][V:], padding_before)
    # The tied head's packed kernel was rebuilt too: logits follow the new embedding.
    torch.testing.assert_close(out["logits"][:, :V], x @ new["model.embed_tokens.weight"].T)
    torch.testing.assert_close(out["norm"], new[p + "input_layernorm.weight"])
    assert done == {"num_params": 7, "num_kernels": 6}   # 7 vLLM tensors from 12 HF ones


def test_a_wrong_shape_is_rejected_naming_the_tensor_before_anything_changes():
    model = FakeVllmQwen2()
    x = torch.randn(2, H)
    before = outputs(model, x)
    bad = hf_state(1)
    bad["model.layers.0.self_attn.k_proj.weight"] = torch.randn(KV + 1, H)
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.k_proj.weight' has 5 rows, vLLM's fused "
                                         "'model.layers.0.self_attn.qkv_proj.weight' expects 4"):
        swap_weights(model, bad, dispatch=fake_dispatch)
    after = outputs(model, x)
    for k in before:
        torch.testing.assert_close(after[k], before[k])


def test_a_failure_mid_commit_restores_every_weight_and_kernel():
    model = FakeVllmQwen2()
    x = torch.randn(2, H)
    before = outputs(model, x)

    class Boom(RuntimeError):
        pass

    down = model.model.layers[0].mlp.down_proj
    original_setattr = type(down).__setattr__

    def failing_setattr(self, name, value):       # the last kernel swap fails, after all copies landed
        if self is down and name == "cpu_linear":
            raise Boom("disk on fire")
        original_setattr(self, name, value)

    PackedLinear.__setattr__ = failing_setattr
    try:
        with pytest.raises(Boom):
            swap_weights(model, hf_state(1), dispatch=fake_dispatch)
    finally:
        PackedLinear.__setattr__ = original_setattr
    after = outputs(model, x)
    for k in before:
        torch.testing.assert_close(after[k], before[k])


def test_plan_check_names_tensors_that_are_missing_or_unknown_to_vllm():
    model = FakeVllmQwen2()
    shapes = {n: tuple(t.shape) for n, t in hf_state(0).items()}
    del shapes["model.layers.0.self_attn.v_proj.weight"]
    problems = check_plan(model, plan_update(model, shapes), shapes)
    assert any("q_proj.weight" in p and "qkv_proj.weight" in p for p in problems)
    shapes = {n: tuple(t.shape) for n, t in hf_state(0).items()} | {"model.extra.weight": (2, 2)}
    problems = check_plan(model, plan_update(model, shapes), shapes)
    assert problems == ["weights: no vLLM module 'model.extra' for tensor 'model.extra.weight'"]


def test_packed_tensors_survive_the_trip_as_bytes():
    state = {"a": torch.randn(3, 2), "b": torch.arange(4, dtype=torch.int64), "c": torch.randn(2).to(torch.bfloat16)}
    back = unpack_tensors(*pack_tensors(state))
    for k, t in state.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t)
