"""LoRA adapters as their own artifact: the trainer's lean adapter forward equals peft's, ExportHF writes a peft
folder that peft itself loads to the trainer's log-probs (merged on request), and a checkpoint names its base model
and is refused by a trainer of another base or of every weight."""

from __future__ import annotations

import json

import pytest
import torch

from services.common.config import load_config
from services.common.errors import FailedPrecondition
from services.trainer.config import LoraSection, TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.model import lora
from services.trainer.testing import make_tiny_model, random_samples
from services.trainer.types import ActorLoss

LORA = {"rank": 4, "alpha": 8}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("lora") / "model")


def engine(model_path: str, lora_cfg=LORA) -> TrainerEngine:
    actor = {"lr": 1e-2} | ({"lora": lora_cfg} if lora_cfg else {})
    return TrainerEngine(load_config(TrainerSettings, data={"model": {"path": model_path}, "actor": actor}))


def ids(samples):
    return [s.prompt_ids for s in samples], [s.response_ids for s in samples]


def trained(model_path: str, seed: int) -> tuple[TrainerEngine, list]:
    e, samples = engine(model_path), random_samples(6, seed=seed)
    for _ in range(2):
        for s, lp in zip(samples, e.compute_logprobs(*ids(samples))):
            s.old_logprobs = lp
        e.train_actor(samples, ActorLoss(mini_batch_size=3))
    return e, samples


def tiny_qwen2(dtype: torch.dtype, lean: bool, blocks: int = 2) -> torch.nn.Module:
    """A small Qwen2 with LoRA on every linear and B random (B = 0 would hide the adapter path); the trainer's lean
    forward (q/k/v and gate/up grouped) or peft's own."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=64, hidden_size=64, num_hidden_layers=blocks, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(dtype)
    lora.apply_lora(model, LoraSection(rank=4, alpha=8), adapter_dtype=torch.float32)
    layers = lora.lora_layers(model)
    assert len(layers) == 7 * blocks and all("forward" in m.__dict__ for m in layers.values())
    assert len({id(g) for g, _ in lora.sibling_groups(model, layers).values()}) == 2 * blocks    # q/k/v, gate/up
    for m in layers.values():
        torch.nn.init.normal_(m.lora_B[lora.ADAPTER].weight, std=0.1)
        if not lean:
            m.__dict__.pop("forward")                                        # peft's own LoraLayer.forward
    return model


def run_step(model, x, autocast: bool):
    """Logits and the adapters' gradients of one backward, and how many grouped ops forward and backward ran."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x, use_cache=False).logits.float()        # no KV cache: a recompute would append to it
        out.square().mean().backward()
    ops = [e.name for e in prof.events()]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    # Compiled blocks call the op (meshrl::lora_group); eager ones its autograd.Function (lora_group._EagerGroup).
    return out.detach(), grads, (ops.count("meshrl::lora_group") + ops.count("_EagerGroup"),
                                 ops.count("meshrl::lora_group_backward") + ops.count("_EagerGroupBackward"))


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, True)])
def test_the_lean_adapter_forward_matches_peft_in_values_and_gradients(dtype, autocast, checkpointing):
    from services.trainer.parallel.parallelize import apply_activation_checkpointing

    model = tiny_qwen2(dtype, lean=True)
    apply_activation_checkpointing(model, checkpointing)
    x = torch.randint(0, 64, (2, 12))
    lean_out, lean_grads, (fwd, bwd) = run_step(model, x, autocast)
    # Two groups a block, two blocks: one op each in forward, again in a full checkpoint's recompute, one backward
    # each. (Under selective checkpointing the profiler also lists the op as its dispatch mode runs it again.)
    assert bwd == 4 and fwd == {"none": 4, "full": 8}.get(checkpointing, fwd)
    peft_out, peft_grads, _ = run_step(tiny_qwen2(dtype, lean=False), x, autocast)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(lean_out, peft_out, atol=tol, rtol=tol)
    assert lean_grads.keys() == peft_grads.keys()
    for n in peft_grads:
        assert lean_grads[n].dtype == torch.float32
        assert torch.allclose(lean_grads[n], peft_grads[n], atol=tol, rtol=tol), n
    # Adapters off (the reference pass) gives the base model's own output.
    peft = tiny_qwen2(dtype, lean=False)
    with lora.adapters_off(model), lora.adapters_off(peft), torch.no_grad():
        assert torch.equal(model(x, use_cache=False).logits, peft(x, use_cache=False).logits)


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_compiled_blocks_run_the_grouped_op_as_one_node_and_match_peft(checkpointing):
    from torch._dynamo.utils import counters

    from services.common.tensors.compile import apply_compile
    from services.trainer.parallel.parallelize import apply_activation_checkpointing

    torch._dynamo.reset()
    counters.clear()
    model = tiny_qwen2(torch.float32, lean=True, blocks=3)
    apply_activation_checkpointing(model, checkpointing)
    apply_compile(model, True)
    x = torch.randint(0, 64, (2, 12))
    run_step(model, x, autocast=False)                                       # compiles (outside the next count)
    lean_out, lean_grads, (fwd, bwd) = run_step(model, x, autocast=False)
    # No graph break (the groups' outputs, left on the normed hidden state, trace away, inside a checkpoint too),
    # one graph for the first block (its input needs no gradient) and one for the others, and each group is one op
    # of the compiled block.
    assert dict(counters["graph_break"]) == {} and counters["stats"]["unique_graphs"] == 2
    assert (fwd, bwd) == (6 * (2 if checkpointing == "full" else 1), 6)
    peft_out, peft_grads, _ = run_step(tiny_qwen2(torch.float32, lean=False, blocks=3), x, autocast=False)
    assert torch.allclose(lean_out, peft_out, atol=1e-5, rtol=1e-5)
    for n in peft_grads:
        assert torch.allclose(lean_grads[n], peft_grads[n], atol=1e-5, rtol=1e-5), n


def test_export_is_a_peft_folder_that_peft_loads_to_the_trainers_logprobs(model_path, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    from services.common.tensors.modeling import load_causal_lm, response_logprobs

    e, samples = trained(model_path, seed=5)
    e.export_hf(str(tmp_path / "adapter"))
    folder = tmp_path / "adapter"
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8)
    tensors = load_file(folder / "adapter_model.safetensors")
    assert tensors and all(k.startswith("base_model.model.model.layers.") and k.endswith((".lora_A.weight",
                                                                                        ".lora_B.weight"))
                           for k in tensors)
    assert any(t.abs().max() > 0 for k, t in tensors.items() if ".lora_B." in k)         # trained, not B = 0
    base = load_causal_lm(model_path, dtype="float32", device="cpu")
    peft_model = PeftModel.from_pretrained(base, str(folder)).eval()
    logp, _ = response_logprobs(peft_model, *ids(samples), pad_id=0)
    want = e.compute_logprobs(*ids(samples))
    for i, s in enumerate(samples):
        assert logp[i, :len(s.response_ids)].tolist() == pytest.approx(want[i], abs=1e-5)
    # merged=True: the plain model, the adapters merged in.
    e.export_hf(str(tmp_path / "merged"), merged=True)
    merged = load_causal_lm(str(tmp_path / "merged"), dtype="float32", device="cpu")
    logp, _ = response_logprobs(merged, *ids(samples), pad_id=0)
    for i, s in enumerate(samples):
        assert logp[i, :len(s.response_ids)].tolist() == pytest.approx(want[i], abs=1e-5)


def test_a_checkpoint_names_its_base_and_another_base_is_refused(model_path, tmp_path):
    from services.trainer.model.adapters import base_identity
    from services.trainer.model.checkpoint import read_meta

    e, samples = trained(model_path, seed=6)
    e.save_checkpoint(str(tmp_path / "ck"))
    meta = read_meta(str(tmp_path / "ck"))
    assert meta["lora_base"] == base_identity(model_path)
    resumed = engine(model_path)
    resumed.load_checkpoint(str(tmp_path / "ck"))
    assert resumed.compute_logprobs(*ids(samples)) == e.compute_logprobs(*ids(samples))
    other = make_tiny_model(tmp_path / "other", seed=1)        # same shapes, other weights
    with pytest.raises(FailedPrecondition, match=r"holds LoRA adapters of base .*model \(digest .*this trainer's "
                                                 r"base is .*other"):
        engine(other).load_checkpoint(str(tmp_path / "ck"))
    with pytest.raises(FailedPrecondition, match=r"holds LoRA adapters .* this trainer trains every weight"):
        engine(model_path, lora_cfg=None).load_checkpoint(str(tmp_path / "ck"))
    full = engine(model_path, lora_cfg=None)
    full.save_checkpoint(str(tmp_path / "full"))
    with pytest.raises(FailedPrecondition, match=r"holds every weight of a model; this trainer trains LoRA"):
        engine(model_path).load_checkpoint(str(tmp_path / "full"))


def test_a_vllm_replica_checks_an_adapter_against_its_base_before_vllm_sees_it(model_path):
    from services.rollout.engine_vllm.adapters import AdapterServing, check_adapter_tensors
    from services.rollout.engine_vllm.engine import hf_reference

    ref = hf_reference(model_path, "float32")                   # q_proj [64, 64], k_proj [32, 64] (2 KV heads)
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj"]}
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    good = {f"{q}.lora_A.weight": torch.zeros(4, 64), f"{q}.lora_B.weight": torch.zeros(64, 4)}
    assert check_adapter_tensors(config, good, ref, max_rank=16) == 4
    k = "base_model.model.model.layers.0.self_attn.k_proj"
    with pytest.raises(ValueError, match=r"k_proj.lora_B.weight' is \[64, 4\], the base layer needs \[32, 4\]"):
        check_adapter_tensors(config, {**good, f"{k}.lora_B.weight": torch.zeros(64, 4)}, ref, max_rank=16)
    with pytest.raises(ValueError, match=r"is no lora_A/lora_B of a linear layer"):
        check_adapter_tensors(config, {"base_model.model.model.nope.lora_A.weight": torch.zeros(4, 64)}, ref, 16)
    with pytest.raises(ValueError, match=r"outside target_modules"):
        check_adapter_tensors({**config, "target_modules": ["k_proj"]}, good, ref, max_rank=16)
    with pytest.raises(ValueError, match=r"rank 4 is not in 1\.\.2"):
        check_adapter_tensors(config, good, ref, max_rank=2)

    class NoLora(AdapterServing):
        pass

    replica = NoLora()
    replica._init_adapters({})                                   # engine args without enable_lora
    assert not replica.supports_adapters
    with pytest.raises(FailedPrecondition, match="serves no adapters; start it with rollout.vllm_engine_args"):
        replica.load_adapter("policy", 1, config, good)
    with pytest.raises(ValueError, match=r"sampling\.adapter: 'policy' is not loaded"):
        replica.lora_request("policy")
    assert replica.lora_request("") is None


def test_under_lora_the_frozen_base_has_no_master_copy_gradients_or_optimizer_state(model_path):
    e = TrainerEngine(load_config(TrainerSettings, data={"model": {"path": model_path, "dtype": "bfloat16"},
                                                         "actor": {"lr": 1e-2, "lora": LORA}}))
    assert (e.rank.param_dtype, e.rank.compute_dtype) == ("float32", "bfloat16")
    params = dict(e.rank.actor.module.named_parameters())
    frozen = {n: p for n, p in params.items() if ".lora_" not in n}
    assert frozen and all(not p.requires_grad and p.dtype == torch.bfloat16 for p in frozen.values())
    assert all(p.requires_grad and p.dtype == torch.float32 for n, p in params.items() if ".lora_" in n)
    samples = random_samples(6, seed=7)
    e.train_actor(samples, ActorLoss(mini_batch_size=3))
    optimized = {id(p) for g in e.rank.actor.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(p) for n, p in params.items() if ".lora_" in n}
    assert set(map(id, (p for p in e.rank.actor.optimizer.state))) <= optimized
    assert all(p.grad is None for p in frozen.values())


def test_a_lora_dropout_the_trainer_would_ignore_is_refused_by_key(model_path):
    from coordinator.recipe.config import RunConfig

    with pytest.raises(ValueError, match=r"actor\.lora\.dropout: the trainer runs without dropout"):
        load_config(RunConfig, data={"model": {"path": model_path}, "actor": {"lora": {"rank": 4, "dropout": 0.1}}})
    assert load_config(RunConfig, data={"actor": {"lora": {"rank": 4, "dropout": 0.0}}}).actor.lora.dropout == 0
