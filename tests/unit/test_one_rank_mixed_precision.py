"""One rank with fp32 master weights and bf16 compute runs FSDP2's mixed precision on a one-rank mesh (bf16
parameters and activations, fp32 masters, gradients and AdamW state) instead of autocast; everything that reads
parameters (weight sync, ExportHF, DCP checkpoints, clipping, the deferred step) sees the masters."""

from __future__ import annotations

import pytest
import torch

from services.common.config import load_config
from services.common.weights import named_weights
from services.trainer.config import TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.testing import make_tiny_model, random_samples
from services.trainer.types import ActorLoss, CriticLoss, CriticSample

LOSS = ActorLoss(kl_coef=0.0, entropy_coef=0.01)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("one_rank_mp") / "model")


def engine(model_path: str, *, autocast: bool = False, model: dict | None = None, **actor) -> TrainerEngine:
    critic = actor.pop("critic", None)
    data = {"model": {"path": model_path, "dtype": "bfloat16", **(model or {})}, "actor": {"lr": 1e-3, **actor}}
    if critic is not None:
        data["critic"] = critic
    return TrainerEngine(load_config(TrainerSettings, data=data), one_rank_autocast=autocast)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def masters(e: TrainerEngine) -> dict[str, torch.Tensor]:
    return {k: local(v).detach().clone() for k, v in named_weights(e.actor.module).items()}


def test_one_rank_bf16_compute_keeps_fp32_masters_and_adam_state_while_forward_runs_bf16(model_path):
    e = engine(model_path)
    assert e.one_rank_fsdp and not e.layout.autocast
    seen = []
    hook = e.actor.module.model.layers[0].mlp.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    e.train_actor(random_samples(4, seed=1), LOSS)
    hook.remove()
    assert seen == [torch.bfloat16]                      # activations, not only matmuls, in bf16
    params = list(e.actor.module.parameters())
    assert all(hasattr(p, "placements") for p in params) and {p.dtype for p in params} == {torch.float32}
    states = list(e.actor.optimizer.state.values())
    assert states and {s["exp_avg"].dtype for s in states} == {s["exp_avg_sq"].dtype for s in states} == {torch.float32}
    assert e.actor.step == 1


def test_losses_and_logprobs_match_the_autocast_path_within_bf16_tolerance(model_path):
    fsdp, amp = engine(model_path), engine(model_path, autocast=True)
    assert amp.layout.autocast and not amp.one_rank_fsdp
    start = masters(amp)
    samples = random_samples(6, seed=3)
    prompts, responses = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
    for a, b in zip(fsdp.compute_logprobs(prompts, responses), amp.compute_logprobs(prompts, responses)):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=3e-2, rtol=0)
    for step in range(2):
        ma, mb = fsdp.train_actor(samples, LOSS), amp.train_actor(samples, LOSS)
        for key in ("loss", "pg_loss", "entropy"):
            assert ma[key] == pytest.approx(mb[key], abs=2e-2, rel=2e-2), (step, key)
        assert ma["grad_norm"] == pytest.approx(mb["grad_norm"], rel=5e-2)
    # Two AdamW steps moved both alike: apart from weights with near-zero gradients (whose sign is noise) they
    # agree far closer than either moved.
    fa, fb = masters(fsdp), masters(amp)
    assert fa.keys() == fb.keys()
    apart = sum(float((fa[k] - fb[k]).abs().sum()) for k in fa)
    moved = sum(float((fb[k] - start[k]).abs().sum()) for k in fb)
    assert apart < 0.1 * moved


def test_synced_weights_are_the_masters_under_hf_names_even_after_a_logprob_pass(model_path):
    from transformers import AutoModelForCausalLM

    e, amp = engine(model_path), engine(model_path, autocast=True)
    samples = random_samples(4, seed=4)
    e.train_actor(samples, LOSS)
    # A pass without gradients leaves FSDP's unsharded bf16 copies on the modules (reshard_after_forward off).
    e.compute_logprobs([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    synced, version = e.state_for_sync()
    hf = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True)
    assert version == 1 and list(synced) == list(named_weights(hf)) == list(amp.state_for_sync()[0])
    assert {t.dtype for t in synced.values()} == {torch.bfloat16}
    assert all(not hasattr(t, "placements") and t.device.type == "cpu" for t in synced.values())
    want = masters(e)
    assert all(torch.equal(synced[k], want[k].to(torch.bfloat16)) for k in want)
    # A float32 sync gets the fp32 masters themselves, not the bf16 compute copies.
    e32 = engine(model_path, weight_sync_dtype="float32")
    e32.train_actor(samples, LOSS)
    e32.compute_logprobs([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    synced32, _ = e32.state_for_sync()
    want32 = masters(e32)
    assert all(torch.equal(synced32[k], want32[k]) for k in want32)
    assert any(not torch.equal(want32[k], want32[k].bfloat16().float()) for k in want32)


def test_export_hf_writes_the_models_names_in_its_dtype(model_path, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    e = engine(model_path)
    e.train_actor(random_samples(4, seed=5), LOSS)
    e.export_hf(str(tmp_path / "hf"))
    saved = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(saved) == set(named_weights(AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True)))
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    want = masters(e)
    assert all(torch.equal(saved[k], want[k].to(torch.bfloat16)) for k in want)


def test_dcp_checkpoint_round_trip_restores_masters_optimizer_and_the_next_step(model_path, tmp_path):
    e = engine(model_path)
    samples = random_samples(4, seed=6)
    e.train_actor(samples, LOSS)
    e.save_checkpoint(str(tmp_path / "ckpt"))
    saved_w = masters(e)
    saved_opt = {k: local(v).clone() for k, v in next(iter(e.actor.optimizer.state.values())).items()}
    after = e.train_actor(random_samples(4, seed=7), LOSS)
    assert any(not torch.equal(saved_w[k], v) for k, v in masters(e).items())
    e.load_checkpoint(str(tmp_path / "ckpt"))
    assert all(torch.equal(saved_w[k], v) for k, v in masters(e).items())
    state = next(iter(e.actor.optimizer.state.values()))
    assert all(torch.equal(saved_opt[k], local(state[k])) for k in saved_opt)
    assert e.actor.step == 1 and e.weight_version == 1
    again = e.train_actor(random_samples(4, seed=7), LOSS)
    assert again["loss"] == after["loss"] and again["grad_norm"] == after["grad_norm"]


@pytest.mark.parametrize("saver_autocast", [True, False], ids=["autocast-to-fsdp", "fsdp-to-autocast"])
def test_a_checkpoint_of_one_path_loads_into_the_other(model_path, tmp_path, saver_autocast):
    saver = engine(model_path, autocast=saver_autocast)
    saver.train_actor(random_samples(4, seed=8), LOSS)
    saver.save_checkpoint(str(tmp_path / "ckpt"))
    loader = engine(model_path, autocast=not saver_autocast)
    loader.load_checkpoint(str(tmp_path / "ckpt"))
    want = masters(saver)
    assert all(torch.equal(want[k], v) for k, v in masters(loader).items())
    saved = next(iter(saver.actor.optimizer.state.values()))
    loaded = next(iter(loader.actor.optimizer.state.values()))
    assert torch.equal(local(saved["exp_avg"]), local(loaded["exp_avg"]))
    assert loader.actor.step == 1


def test_deferred_fused_step_skips_a_non_finite_norm_and_clipping_bounds_the_step(model_path):
    # On CUDA the trainer picks the fused AdamW itself; on a CPU it is asked for (torch has a CPU fused kernel).
    e = engine(model_path, grad_clip=1e-3)
    a = e.actor
    a.optimizer = torch.optim.AdamW([p for p in a.module.parameters() if p.requires_grad], lr=1e-3, fused=True)
    a.scheduler = torch.optim.lr_scheduler.LambdaLR(a.optimizer, lambda step: 1.0)
    m = e.train_actor(random_samples(4, seed=9), LOSS)
    assert m["num_optimizer_steps"] == 1 and m["grad_norm"] > 1e-3
    grads = []
    hook = a.optimizer.register_step_pre_hook(
        lambda opt, *_: grads.append(sum(float(local(p.grad).float().square().sum()) for p in a.module.parameters())))
    e.train_actor(random_samples(4, seed=10), LOSS)
    hook.remove()
    assert grads[0] ** 0.5 == pytest.approx(1e-3, rel=1e-3)     # clipped to grad_clip before the step
    with torch.no_grad():
        local(a.module.model.norm.weight)[0] = float("inf")     # every gradient becomes non-finite
    before = masters(e)
    m = e.train_actor(random_samples(4, seed=11), LOSS)
    assert m["num_skipped_steps"] == 1 and a.step == 2
    after = masters(e)
    assert all(torch.equal(before[k], after[k]) for k in before if k != "model.norm.weight")


def test_activation_checkpointing_and_the_critic_run_on_the_fsdp_path(model_path):
    plain, ckpt = engine(model_path), engine(model_path, activation_checkpointing="full")
    samples = random_samples(4, seed=12)
    assert plain.train_actor(samples, LOSS)["loss"] == pytest.approx(ckpt.train_actor(samples, LOSS)["loss"], abs=1e-6)
    assert all(torch.equal(v, masters(ckpt)[k]) for k, v in masters(plain).items())
    e = engine(model_path, critic={"lr": 1e-2})
    critic = [CriticSample(s.prompt_ids, s.response_ids, [1.0] * len(s.response_ids)) for s in samples]
    e.train_critic(critic, CriticLoss(clip_value=0.0, ppo_epochs=2))
    assert {p.dtype for p in e.critic.module.parameters()} == {torch.float32}
    values = e.compute_values([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    assert [len(v) for v in values] == [len(s.response_ids) for s in samples]


def test_a_logprob_pass_frees_each_blocks_bf16_copy_and_leaves_only_masters(model_path):
    e = engine(model_path)
    samples = random_samples(4, seed=13)
    layers = list(e.actor.module.model.layers)
    live = []

    def count(block):       # while `block`'s MLP runs: its own bf16 parameters, and the other blocks'
        return lambda m, i, o: live.append(tuple(sum(p.dtype == torch.bfloat16 for p in b.parameters())
                                                 for b in (block, *(x for x in layers if x is not block))))
    hooks = [b.mlp.register_forward_hook(count(b)) for b in layers]
    e.compute_logprobs([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    n = len(list(layers[0].parameters()))
    assert live == [(n, 0), (n, 0)]                      # only the running block holds its copy
    assert all(hasattr(p, "placements") and p.dtype == torch.float32 for p in e.actor.module.parameters())
    live.clear()
    e.train_actor(samples, LOSS)                         # a training forward keeps the copies for backward
    for h in hooks:
        h.remove()
    assert live == [(n, 0), (n, n)]
    assert all(hasattr(p, "placements") for p in e.actor.module.parameters())
