"""TrainerEngine without a server: updates, validation, parity with the reference, checkpoints, export."""

from __future__ import annotations

import math

import pytest
import torch

from services.common.config import load_config
from services.common.errors import FailedPrecondition, NotFound
from services.common.tensors.weights import named_weights
from services.trainer.config import ActorConfig, TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.model.optim import lr_lambda
from services.trainer.testing import make_tiny_model, random_samples
from services.trainer.types import ActorLoss, CriticLoss, CriticSample, TrainSample


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def make_engine(model_path: str, **actor) -> TrainerEngine:
    critic = actor.pop("critic", None)
    data = {"model": {"path": model_path}, "actor": {"lr": 1e-2, **actor}}
    if critic is not None:
        data["critic"] = critic
    return load_config(TrainerSettings, data=data)


def engine(model_path: str, **actor) -> TrainerEngine:
    return TrainerEngine(make_engine(model_path, **actor))


def params(e: TrainerEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in named_weights(e.rank.actor.module).items()}


def with_old_logprobs(e: TrainerEngine, samples: list[TrainSample]) -> list[TrainSample]:
    lps = e.compute_logprobs([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    for s, lp in zip(samples, lps):
        s.old_logprobs = lp
    return samples


def test_one_grpo_step_with_positive_advantage_raises_the_sampled_responses_logprob(model_path):
    e = engine(model_path, lr=1e-2)
    prompt = [1, 5, 6, 7]
    # Sample a response from the policy itself, as rollout would.
    g = torch.Generator().manual_seed(0)
    response = []
    with torch.no_grad():
        for _ in range(6):
            logits = e.rank.actor.module(input_ids=torch.tensor([prompt + response])).logits[0, -1]
            response.append(int(torch.multinomial(logits.softmax(-1), 1, generator=g)))
    before = e.compute_logprobs([prompt], [response])[0]
    sample = TrainSample(prompt, response, advantages=[1.0] * len(response), old_logprobs=before)
    metrics = e.train_actor([sample], ActorLoss())
    after = e.compute_logprobs([prompt], [response])[0]
    assert sum(after) > sum(before) + 0.1
    assert metrics["clip_frac"] == 0.0           # on-policy: the first step's ratio is exactly 1
    assert metrics["approx_kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["num_tokens"] == len(response)
    assert e.rank.weight_version == 1 and e.rank.actor.step == 1


def test_train_actor_reports_every_metric_the_coordinator_records(model_path):
    e = engine(model_path)
    samples = with_old_logprobs(e, random_samples(6))
    for s in samples:
        s.ref_logprobs = [x - 0.1 for x in s.old_logprobs]
    metrics = e.train_actor(samples, ActorLoss(kl_coef=0.1, entropy_coef=0.01, mini_batch_size=3, ppo_epochs=2))
    for key in ("pg_loss", "kl_loss", "entropy", "clip_frac", "approx_kl", "grad_norm", "lr", "tokens_per_s",
                "num_tokens"):
        assert key in metrics and math.isfinite(metrics[key]), key
    assert metrics["num_optimizer_steps"] == 4
    assert metrics["kl_loss"] > 0
    assert metrics["entropy"] > 0
    assert e.rank.actor.step == 4 and e.rank.weight_version == 1


def _bad_cases():
    def base():
        return [TrainSample([1, 4], [5, 6, 7], [1.0, 1.0, 1.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]),
                TrainSample([1, 4], [5, 6], [1.0, 1.0], [-1.0, -1.0], [-1.0, -1.0])]

    def edit(fn, **loss):
        samples = base()
        fn(samples)
        return samples, ActorLoss(**loss)

    return {
        "advantages length": (edit(lambda s: s[1].advantages.pop()), r"samples\[1\]\.advantages"),
        "old_logprobs length": (edit(lambda s: s[0].old_logprobs.append(0.0)), r"samples\[0\]\.old_logprobs"),
        "ref_logprobs length with kl": (edit(lambda s: s[1].ref_logprobs.clear(), kl_coef=0.1),
                                        r"samples\[1\]\.ref_logprobs"),
        "empty batch": (([], ActorLoss()), "samples: empty batch"),
        "nan advantage": (edit(lambda s: s[1].advantages.__setitem__(1, float("nan"))),
                          r"samples\[1\]\.advantages\[1\]: not finite"),
        "inf old logprob": (edit(lambda s: s[0].old_logprobs.__setitem__(2, float("-inf"))),
                            r"samples\[0\]\.old_logprobs\[2\]: not finite"),
        "unknown kl_type": (edit(lambda s: None, kl_type="k7"), "loss.kl_type"),
        "unknown loss_agg_mode": (edit(lambda s: None, loss_agg_mode="sum"), "loss.loss_agg_mode"),
        "unknown policy loss": (edit(lambda s: None, policy_loss="ppo2"), r"loss\.policy_loss\.name: unknown"),
        "a setting of another loss": (edit(lambda s: None, policy_loss="gspo",
                                           policy_loss_settings={"clip_ratio_c": 3}),
                                      r"loss\.policy_loss\.clip_ratio_c: not a setting of policy loss 'gspo'"),
        "norm without its length": (edit(lambda s: None, loss_agg_mode="seq-mean-token-sum-norm"),
                                    "loss.loss_scale_factor"),
        "token outside vocab": (edit(lambda s: s[1].response_ids.__setitem__(0, 32)),
                                r"samples\[1\]\.response_ids: token id 32"),
        "negative token": (edit(lambda s: s[0].prompt_ids.__setitem__(0, -1)), r"samples\[0\]\.prompt_ids"),
    }


BAD = _bad_cases()


@pytest.fixture(scope="module")
def shared_engine(model_path) -> TrainerEngine:
    return engine(model_path)


@pytest.mark.parametrize("case", list(BAD))
def test_bad_train_input_is_a_value_error_naming_the_field_and_nothing_is_applied(shared_engine, case):
    (samples, loss), pattern = BAD[case]
    e = shared_engine
    before, version, step = params(e), e.rank.weight_version, e.rank.actor.step
    with pytest.raises(ValueError, match=pattern):
        e.train_actor(samples, loss)
    after = params(e)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert (e.rank.weight_version, e.rank.actor.step) == (version, step)
    assert not e.rank.actor.optimizer.state


def test_trainer_logprobs_equal_the_reference_services_bit_for_bit(model_path):
    from services.reference.config import ReferenceSettings
    from services.reference.engine import ReferenceEngine

    ref = ReferenceEngine(load_config(ReferenceSettings, data={"model": {"path": model_path}}))
    e = engine(model_path)
    samples = random_samples(9, seed=3)
    prompts, responses = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
    assert e.compute_logprobs(prompts, responses) == ref.logprobs_sync(prompts, responses)
    assert e.compute_logprobs(prompts, responses, 0.7) == ref.logprobs_sync(prompts, responses, 0.7)


def test_a_mesh_that_does_not_match_the_world_size_fails_before_the_model_loads(tmp_path):
    settings = load_config(TrainerSettings, data={"model": {"path": str(tmp_path / "missing")},
                                                  "actor": {"dp_size": 2, "tp_size": 2}})
    with pytest.raises(ValueError) as err:
        TrainerEngine(settings)
    assert str(err.value) == ("actor.tp_size * actor.pp_size * actor.dp_size = 2 * 1 * 2 = 4, but the trainer has 1 "
                              "rank(s) (torchrun --nproc_per_node x --nnodes); no actor.dp_size fits: make torchrun "
                              "--nproc_per_node x --nnodes a multiple of tp_size * pp_size = 2, or lower "
                              "actor.tp_size / actor.pp_size")


@pytest.mark.parametrize("section, key", [("model", "path"), ("actor", "model_path")])
def test_a_model_folder_without_config_is_named_by_the_key_the_user_set(tmp_path, section, key):
    missing = str(tmp_path / "missing")
    settings = load_config(TrainerSettings, data={section: {key: missing}})
    with pytest.raises(ValueError) as err:
        TrainerEngine(settings)
    assert str(err.value) == f"{section}.{key}: {missing!r} is not a Hugging Face model folder (no config.json)"


@pytest.mark.parametrize("mode,policy", [("token-mean", "vanilla"), ("seq-mean-token-sum", "vanilla"),
                                         ("seq-mean-token-mean", "vanilla"), ("seq-mean-token-sum-norm", "vanilla"),
                                         ("seq-mean-token-mean", "gspo"), ("token-mean", "cispo")])
def test_gradient_accumulation_over_micro_batches_equals_one_big_batch(model_path, mode, policy):
    # A small lr: Adam's first step is lr * g / (|g| + eps), so near-zero gradients amplify rounding.
    big = engine(model_path, lr=1e-4, micro_batch_token_budget=100_000, shuffle=False)
    small = engine(model_path, lr=1e-4, micro_batch_token_budget=8, shuffle=False)   # ~one sample per micro-batch
    samples = with_old_logprobs(big, random_samples(8, seed=1))
    loss = ActorLoss(loss_agg_mode=mode, loss_scale_factor=6.0, policy_loss=policy)
    m_big = big.train_actor(samples, loss)
    m_small = small.train_actor(samples, loss)
    assert m_small["pg_loss"] == pytest.approx(m_big["pg_loss"], abs=1e-6)
    assert m_small["grad_norm"] == pytest.approx(m_big["grad_norm"], rel=1e-5)
    pb, ps = params(big), params(small)
    assert max((pb[k] - ps[k]).abs().max().item() for k in pb) < 1e-6


def test_checkpoint_round_trip_gives_the_same_next_step_as_an_uninterrupted_run(model_path, tmp_path):
    samples = [random_samples(6, seed=s) for s in range(3)]
    loss = ActorLoss(mini_batch_size=3)
    a = engine(model_path, lr_schedule="cosine", warmup_steps=1, total_steps=10)
    a.train_actor(with_old_logprobs(a, samples[0]), loss)
    a.save_checkpoint(str(tmp_path / "ck"))
    a.train_actor(with_old_logprobs(a, samples[1]), loss)
    expected = a.train_actor(with_old_logprobs(a, samples[2]), loss)

    b = engine(model_path, lr_schedule="cosine", warmup_steps=1, total_steps=10)
    info = b.load_checkpoint(str(tmp_path / "ck"))
    assert info["step"] == 2 and info["weight_version"] == 1
    b.train_actor(with_old_logprobs(b, samples[1]), loss)
    got = b.train_actor(with_old_logprobs(b, samples[2]), loss)
    assert got["pg_loss"] == pytest.approx(expected["pg_loss"], abs=1e-6)
    assert got["lr"] == pytest.approx(expected["lr"])
    pa, pb = params(a), params(b)
    assert max((pa[k] - pb[k]).abs().max().item() for k in pa) < 1e-6
    assert b.rank.weight_version == a.rank.weight_version == 3


def test_loading_a_missing_checkpoint_is_not_found(shared_engine, tmp_path):
    with pytest.raises(NotFound, match="path"):
        shared_engine.load_checkpoint(str(tmp_path / "nothing"))


def test_exported_hf_folder_loads_with_from_pretrained_and_scores_like_the_trainer(model_path, tmp_path):
    from services.common.tensors.fused import enable_fused_head
    from services.common.tensors.modeling import batched_logprobs, load_causal_lm

    (tmp_path / "src").mkdir()
    src = make_tiny_model(tmp_path / "src")
    (tmp_path / "src" / "tokenizer_config.json").write_text("{}")
    e = engine(src)
    samples = with_old_logprobs(e, random_samples(4))
    e.train_actor(samples, ActorLoss())
    e.export_hf(str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "tokenizer_config.json").read_text() == "{}"
    exported = load_causal_lm(str(tmp_path / "hf"))
    # Scored the trainer's way (padded rows, fused head: the defaults), the numbers are the same bits.
    enable_fused_head(exported)
    prompts, responses = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
    assert batched_logprobs(exported, prompts, responses, pad_id=0, fused=True) == \
        e.compute_logprobs(prompts, responses)


def test_weights_for_sync_carry_hf_names_once_per_tied_tensor_and_the_version(shared_engine):
    state, version = shared_engine.state_for_sync()
    assert "model.embed_tokens.weight" in state and "lm_head.weight" not in state
    assert "model.layers.1.mlp.down_proj.weight" in state
    assert version == shared_engine.rank.weight_version
    assert all(t.device.type == "cpu" for t in state.values())


def test_learning_rate_warms_up_linearly_then_follows_the_cosine():
    cfg = ActorConfig(lr=1.0, lr_schedule="cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    f = lr_lambda(cfg)
    assert [f(0), f(1)] == [0.5, 1.0]
    assert f(2) == pytest.approx(1.0)
    assert f(4) == pytest.approx(0.1 + 0.9 * 0.5)
    assert f(6) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)


def test_a_cosine_schedule_without_total_steps_is_rejected_naming_the_key(model_path):
    with pytest.raises(ValueError, match="total_steps"):
        make_engine(model_path, lr_schedule="cosine", warmup_steps=5)


def test_values_and_critic_training_need_a_critic_section(shared_engine):
    with pytest.raises(FailedPrecondition, match="no critic configured"):
        shared_engine.compute_values([[1, 2]], [[3]])
    with pytest.raises(FailedPrecondition, match="no critic configured"):
        shared_engine.train_critic([CriticSample([1], [3], [1.0])], CriticLoss())


def test_critic_updates_move_values_toward_returns_and_never_touch_the_actor(model_path):
    e = engine(model_path, critic={"lr": 1e-3})
    prompts, responses = [[1, 4, 5], [1, 6]], [[7, 8, 9], [10, 11]]
    returns = [[1.0, 1.0, 1.0], [-1.0, -1.0]]
    old = e.compute_values(prompts, responses)
    actor_before = params(e)
    samples = [CriticSample(p, r, ret, o) for p, r, ret, o in zip(prompts, responses, returns, old)]
    first = e.train_critic(samples, CriticLoss(clip_value=0.0, ppo_epochs=3))
    after = e.compute_values(prompts, responses)
    err = lambda vs: sum((v - t) ** 2 for row, rt in zip(vs, returns) for v, t in zip(row, rt))  # noqa: E731
    assert err(after) < err(old)
    assert first["num_optimizer_steps"] == 3 and e.rank.critic.step == 3
    assert all(torch.equal(actor_before[k], v) for k, v in params(e).items())
    assert e.rank.weight_version == 0 and e.rank.actor.step == 0

    critic_before = {k: v.detach().clone() for k, v in e.rank.critic.module.named_parameters()}
    train = with_old_logprobs(e, random_samples(3))
    e.train_actor(train, ActorLoss())
    assert all(torch.equal(critic_before[k], v) for k, v in e.rank.critic.module.named_parameters())


def test_value_clipping_bounds_how_far_one_step_moves_from_old_values(model_path):
    prompts, responses = [[1, 4, 5]], [[7, 8, 9]]

    def moved(clip_value: float) -> tuple[float, dict, TrainerEngine, list, list]:
        """Largest |new - old| value after one TrainCritic of 8 epochs towards returns 100 above the old values."""
        e = engine(model_path, critic={"lr": 1e-2})
        old = e.compute_values(prompts, responses)[0]
        far = [v + 100.0 for v in old]
        metrics = e.train_critic([CriticSample(prompts[0], responses[0], far, old)],
                                 CriticLoss(clip_value=clip_value, ppo_epochs=8))
        new = e.compute_values(prompts, responses)[0]
        assert all(n > o for n, o in zip(new, old))          # both move towards the returns
        return max(abs(n - o) for n, o in zip(new, old)), metrics, e, far, old

    clipped, metrics, e, far, _ = moved(0.2)
    unclipped, free_metrics, _, _, _ = moved(0.0)
    # Past old +- 0.2 the clipped term has no gradient: later epochs add only the optimizer's momentum.
    assert clipped < 0.6 * unclipped, (clipped, unclipped)
    assert metrics["vf_clip_frac"] > 0.5 and free_metrics["vf_clip_frac"] == 0.0
    with pytest.raises(ValueError, match=r"samples\[0\]\.old_values"):
        e.train_critic([CriticSample(prompts[0], responses[0], far, [])], CriticLoss(clip_value=0.2))


@pytest.mark.parametrize("actor,critic,pattern", [
    (dict(pp_size=2), {}, "critic: a critic with actor.pp_size > 1"),
    (dict(dp_size=0), None, "actor.dp_size"),
])
def test_unsupported_or_invalid_mesh_settings_fail_before_the_model_loads(tmp_path, actor, critic, pattern):
    data = {"model": {"path": str(tmp_path / "missing")}, "actor": actor}
    if critic is not None:
        data["critic"] = critic
    with pytest.raises(ValueError, match=pattern):
        TrainerEngine(load_config(TrainerSettings, data=data))


def test_a_single_process_reports_no_pipeline_bubble_and_its_mesh(shared_engine):
    info = shared_engine.info()
    assert (info["tp"], info["pp"], info["dp"], info["world_size"], info["devices"]) == (1, 1, 1, 1, "cpu")
    assert shared_engine.bubble_fraction() == 0.0
