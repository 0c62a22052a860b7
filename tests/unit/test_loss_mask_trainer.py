"""The loss mask in the trainer: every loss term (policy with dual clip, KL, entropy, value) and every aggregation
mode counts the model's tokens only; an episode's observation tokens may carry any advantage, old or reference
log-prob or return and the update (loss, gradients, weights, metrics) is the same. Padded and packed rows."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch

from services.common.config import load_config
from services.common.tensors.weights import named_weights
from services.trainer import convert
from services.trainer.config import TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.updates.losses import AGG_MODES
from services.trainer.testing import make_tiny_model, random_samples
from services.trainer.types import ActorLoss, CriticLoss, CriticSample, TrainSample
from services.trainer.updates.actor import actor_loss

LOSS = dict(kl_coef=0.1, entropy_coef=0.01, loss_scale_factor=8.0,
            policy_loss_settings={"clip_ratio_c": 3.0, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28})


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_mask") / "model")


def _engine(model_path: str, packed: bool = False, **sections) -> TrainerEngine:
    data = {"model": {"path": model_path},
            "actor": {"lr": 1e-2, "shuffle": False, "use_remove_padding": packed, "seed": 5}, **sections}
    return TrainerEngine(load_config(TrainerSettings, data=data))


def _holed_mask(rng: random.Random, n: int) -> np.ndarray:
    """1 first (the model speaks first), then observation blocks in between; at least one 0 when n > 1."""
    mask = np.ones(n, dtype=np.uint8)
    if n > 1:
        start = rng.randint(1, n - 1)
        mask[start:rng.randint(start + 1, n)] = 0
    return mask


def _episodes(engine: TrainerEngine, seed: int = 0) -> list[TrainSample]:
    """Samples with holed loss masks; old log-probs from the engine, reference ones a little off."""
    rng = random.Random(seed)
    samples = random_samples(8, seed=seed, max_prompt=5, max_response=14)
    lps = engine.compute_logprobs([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    for s, lp in zip(samples, lps):
        s.old_logprobs = [x + rng.uniform(-0.1, 0.1) for x in lp]
        s.ref_logprobs = [x - 0.05 for x in lp]
        s.loss_mask = _holed_mask(rng, len(s.response_ids))
    assert sum(int((s.loss_mask == 0).sum()) for s in samples) >= 4
    return samples


def _on_observations(samples: list[TrainSample], value) -> list[TrainSample]:
    """A copy whose observation tokens' advantages, old and reference log-probs are `value(rng)` each."""
    rng = random.Random(99)
    out = copy.deepcopy(samples)
    for s in out:
        for name in ("advantages", "old_logprobs", "ref_logprobs"):
            row = list(getattr(s, name))
            for t in np.flatnonzero(s.loss_mask == 0):
                row[t] = value(rng)
            setattr(s, name, row)
    return out


def _weights(e: TrainerEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in named_weights(e.rank.actor.module).items()}


@pytest.mark.parametrize("mode", list(AGG_MODES))
def test_the_masked_loss_equals_the_loss_over_the_model_tokens_alone_with_the_same_gradients(mode):
    g = torch.Generator().manual_seed(0)
    B, T = 4, 9
    logp = (-torch.rand(B, T, generator=g) * 2).requires_grad_()
    entropy = torch.rand(B, T, generator=g).requires_grad_()
    old, ref = -torch.rand(B, T, generator=g) * 2, -torch.rand(B, T, generator=g) * 2
    adv = torch.randn(B, T, generator=g)
    lengths = torch.tensor([9, 7, 5, 3])
    loss_mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 1, 1], [1, 0, 0, 1, 1, 1, 1, 0, 0],
                              [1, 1, 1, 0, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    mask = (torch.arange(T) < lengths.unsqueeze(1)) & loss_mask
    loss = ActorLoss(loss_agg_mode=mode, **LOSS)
    units = int(mask.sum()) if AGG_MODES[mode].unit == "token" else B
    total, stats = actor_loss(logp, mask, entropy, old, adv, ref, loss, units)
    total.backward()
    grads = logp.grad.clone(), entropy.grad.clone()

    # The observation tokens' inputs scrambled: nothing changes.
    logp2, ent2 = logp.detach().clone().requires_grad_(), entropy.detach().clone().requires_grad_()
    off = ~mask
    scramble = lambda x: torch.where(off, torch.randn(B, T, generator=g) * 100, x)  # noqa: E731
    total2, stats2 = actor_loss(logp2, mask, ent2, scramble(old), scramble(adv), scramble(ref), loss, units)
    total2.backward()
    assert torch.equal(total, total2) and torch.equal(stats, stats2)
    assert torch.equal(logp2.grad, grads[0]) and torch.equal(ent2.grad, grads[1])
    assert not grads[0][off].any() and not grads[1][off].any()

    # By hand, on each row's model tokens cut out into a list.
    rows = [[t for t in range(T) if mask[b, t]] for b in range(B)]
    logp, entropy = logp.detach(), entropy.detach()
    per_row = []
    for b, ts in enumerate(rows):
        terms = []
        for t in ts:
            a, r = float(adv[b, t]), float((logp[b, t] - old[b, t]).exp())
            pg = max(-a * r, -a * min(max(r, 0.8), 1.28))
            if a < 0:
                pg = min(pg, -a * 3.0)
            x = float(ref[b, t] - logp[b, t])
            kl = min(max(np.exp(x) - x - 1.0, -10.0), 10.0)
            terms.append(pg + 0.1 * kl - 0.01 * float(entropy[b, t]))
        per_row.append(terms)
    if mode == "token-mean":
        want = sum(sum(r) for r in per_row) / sum(len(r) for r in per_row)
    elif mode == "seq-mean-token-sum":
        want = sum(sum(r) for r in per_row) / B
    elif mode == "seq-mean-token-sum-norm":
        want = sum(sum(r) / 8.0 for r in per_row) / B
    else:
        want = sum(sum(r) / len(r) for r in per_row) / B
    assert float(total.detach()) == pytest.approx(want, rel=1e-5)
    assert float(stats[-1]) == int(mask.sum())


def _train_twice(model_path, samples_a, samples_b, loss, packed):
    a, b = _engine(model_path, packed), _engine(model_path, packed)
    return a.train_actor(samples_a, loss), a, b.train_actor(samples_b, loss), b


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("mode", list(AGG_MODES))
def test_observation_tokens_with_huge_advantages_train_exactly_like_zeroed_ones(model_path, mode, packed):
    base = _episodes(_engine(model_path, packed))
    huge = _on_observations(base, lambda rng: rng.uniform(-1e4, 1e4))
    zeroed = _on_observations(base, lambda rng: 0.0)
    # Two epochs over two mini-batches: the normalisers and the old log-probs of every mini-batch are exercised.
    loss = ActorLoss(loss_agg_mode=mode, ppo_epochs=2, mini_batch_size=4, **LOSS)
    got, a, want, b = _train_twice(model_path, huge, zeroed, loss, packed)
    for key in ("pg_loss", "kl_loss", "entropy_loss", "loss", "entropy", "clip_frac", "approx_kl", "grad_norm",
                "num_tokens"):
        assert got[key] == want[key], key
    wa, wb = _weights(a), _weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert got["num_tokens"] == sum(int(s.loss_mask.sum()) for s in base)

    # Without the mask the same huge batch trains differently: the equality above is the mask's doing.
    unmasked = copy.deepcopy(huge)
    for s in unmasked:
        s.loss_mask = []
    plain = _engine(model_path, packed).train_actor(unmasked, loss)
    assert plain["pg_loss"] != got["pg_loss"] and plain["num_tokens"] == sum(len(s.response_ids) for s in base)


def test_entropy_and_token_metrics_average_over_the_model_tokens_only(model_path):
    from transformers import AutoModelForCausalLM

    e = _engine(model_path)
    samples = _episodes(e)
    for s in samples:
        s.old_logprobs = []            # on-policy, one optimizer step: the metrics are the initial weights'
    metrics = e.train_actor(samples, ActorLoss())
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([list(s.prompt_ids) + list(s.response_ids)])
            logits = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1:-1]           # predicts each response token
            logp = torch.log_softmax(logits.float(), -1)
            ent = -(logp.exp() * logp).sum(-1)
            total += float(ent[torch.from_numpy(s.loss_mask.astype(bool))].sum())
            count += int(s.loss_mask.sum())
    assert metrics["entropy"] == pytest.approx(total / count, rel=1e-5)
    assert metrics["num_tokens"] == count and metrics["approx_kl"] == 0.0 and metrics["clip_frac"] == 0.0


def test_the_value_loss_counts_the_model_tokens_only(model_path):
    rng = random.Random(3)
    critic = {"critic": {"lr": 1e-2}}
    samples = []
    for s in random_samples(6, seed=4, max_response=12):
        mask = _holed_mask(rng, len(s.response_ids))
        samples.append(CriticSample(s.prompt_ids, s.response_ids, [rng.uniform(-1, 1) for _ in s.response_ids],
                                    [0.0] * len(s.response_ids), loss_mask=mask))
    scrambled = copy.deepcopy(samples)
    for s in scrambled:
        for t in np.flatnonzero(s.loss_mask == 0):
            s.returns[t], s.old_values[t] = rng.uniform(-1e3, 1e3), rng.uniform(-1e3, 1e3)
    loss = CriticLoss(clip_value=0.5, ppo_epochs=2, mini_batch_size=3)
    a, b = _engine(model_path, **critic), _engine(model_path, **critic)
    got, want = a.train_critic(samples, loss), b.train_critic(scrambled, loss)
    for key in ("vf_loss", "vf_clip_frac", "values_mean", "grad_norm", "num_tokens"):
        assert got[key] == want[key], key
    assert got["num_tokens"] == sum(int(s.loss_mask.sum()) for s in samples) < sum(len(s.response_ids)
                                                                                    for s in samples)
    ca = dict(a.rank.critic.module.named_parameters())
    assert all(torch.equal(ca[k], v) for k, v in b.rank.critic.module.named_parameters())


@pytest.mark.parametrize("mask,error", [([1, 0], r"samples\[0\]\.loss_mask: 2 values for 3 response tokens"),
                                        ([1, 2, 0], r"samples\[0\]\.loss_mask\[1\]: must be 0 or 1, got 2")])
def test_a_bad_loss_mask_is_refused_by_name(model_path, mask, error):
    e = _engine(model_path, critic={"lr": 1e-2})
    s = TrainSample([5, 6], [7, 8, 9], [1.0, 1.0, 1.0], [], loss_mask=np.array(mask, dtype=np.uint8))
    with pytest.raises(ValueError, match=error):
        e.train_actor([s], ActorLoss())
    with pytest.raises(ValueError, match=error):
        e.train_critic([CriticSample([5, 6], [7, 8, 9], [0.0] * 3, loss_mask=mask)], CriticLoss())
    if len(mask) != 3:                                  # the sender checks the length too
        with pytest.raises(ValueError, match=error):
            convert.train_columns_to_pb([s])


def test_the_mask_travels_in_columns_per_sample_messages_and_critic_samples():
    a = TrainSample([1, 2], [3, 4, 5], [0.5, 0.5, 0.5], [], loss_mask=np.array([1, 0, 1], dtype=np.uint8))
    b = TrainSample([1], [3, 4], [0.1, 0.2], [])          # no mask: all ones on the wire
    for request in (convert.train_actor_to_pb([a, b], ActorLoss(), columnar=True),
                    convert.train_actor_to_pb([a, b], ActorLoss(), packed=True),
                    convert.train_actor_to_pb([a, b], ActorLoss())):
        got, _ = convert.train_actor_from_pb(request)
        assert [list(s.loss_mask) for s in got] in ([[1, 0, 1], [1, 1]], [[1, 0, 1], []])
    assert convert.train_columns_to_pb([b]).loss_mask == b""
    critic = convert.train_critic_to_pb([CriticSample([1], [3, 4], [1.0, 2.0], loss_mask=[0, 1])], CriticLoss())
    got, _ = convert.train_critic_from_pb(critic)
    assert list(got[0].loss_mask) == [0, 1]
