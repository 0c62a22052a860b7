"""The loss mask on the coordinator's side: every advantage estimator, the KL in the reward, rollout correction,
the sample metrics and samples.jsonl see an episode's model tokens only, as if its observation tokens were not
there (a mask with holes, not only a length prefix)."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from coordinator.recipe.config import AlgorithmConfig, RolloutCorrectionConfig
from coordinator.recipe.data import Problem
from coordinator.training import advantages as adv_fns
from coordinator.training.phases import compute_advantages, token_mask
from coordinator.training.reporting import observation_spans, sample_metrics, sample_record
from coordinator.training.remote import Sample


def _episode(rng: random.Random, problem: Problem, group: int) -> Sample:
    """A multi-turn sample: model turns with observation blocks between them (sometimes one at the end too)."""
    mask: list[int] = []
    for turn in range(rng.randint(1, 3)):
        if turn:
            mask += [0] * rng.randint(1, 4)
        mask += [1] * rng.randint(1, 4)
    if rng.random() < 0.3:
        mask += [0] * rng.randint(1, 3)        # ended on an observation (max_turns after a tool call)
    n = len(mask)
    f = lambda lo, hi: np.array([rng.uniform(lo, hi) for _ in range(n)], dtype=np.float32)  # noqa: E731
    s = Sample(problem, group, np.array([1, 2], dtype=np.int32), np.arange(3, 3 + n, dtype=np.int32), f(-2, -0.1),
               "", "stop", 0, reward=float(rng.randint(0, 3)), loss_mask=np.array(mask, dtype=np.uint8))
    s.old_logprobs, s.ref_logprobs, s.values = f(-2, -0.1), f(-2, -0.1), f(-1, 1)
    return s


def _batch(seed: int = 0, num_groups: int = 4, n: int = 3) -> list[Sample]:
    rng = random.Random(seed)
    return [_episode(rng, Problem(id=f"q{g}", prompt="p", ground_truth="1", data_source="arith"), g)
            for g in range(num_groups) for _ in range(n)]


def _compacted(s: Sample) -> Sample:
    """The same sample with its observation tokens cut out: what the masked one must be equivalent to."""
    keep = s.loss_mask.astype(bool)
    cut = lambda x: np.asarray(x)[keep]  # noqa: E731
    return dataclasses.replace(s, response_ids=cut(s.response_ids), rollout_logprobs=cut(s.rollout_logprobs),
                               old_logprobs=cut(s.old_logprobs), ref_logprobs=cut(s.ref_logprobs),
                               values=cut(s.values), loss_mask=None)


def _scrambled(s: Sample, rng: random.Random) -> Sample:
    """The same sample with arbitrary values on its observation tokens."""
    obs = ~s.loss_mask.astype(bool)

    def noise(x):
        x = np.array(x, dtype=np.float32)
        x[obs] = [rng.uniform(-50, 50) for _ in range(int(obs.sum()))]
        return x
    return dataclasses.replace(s, rollout_logprobs=noise(s.rollout_logprobs), old_logprobs=noise(s.old_logprobs),
                               ref_logprobs=noise(s.ref_logprobs), values=noise(s.values))


def _ctx(algorithm: AlgorithmConfig):
    return SimpleNamespace(cfg=SimpleNamespace(algorithm=algorithm), kl_coef=0.1, kl_controller=None)


ALGORITHMS = {
    **{name: AlgorithmConfig(adv_estimator=name) for name in adv_fns.ADVANTAGE_ESTIMATORS},
    "gae-gamma-lambda": AlgorithmConfig(adv_estimator="gae", gamma=0.9, lam=0.8),
    "reinforce-gamma": AlgorithmConfig(adv_estimator="reinforce_plus_plus", gamma=0.9),
    "grpo-kl-in-reward": AlgorithmConfig(adv_estimator="grpo", use_kl_in_reward=True),
    "gae-kl-in-reward": AlgorithmConfig(adv_estimator="gae", use_kl_in_reward=True, gamma=0.95, lam=0.9),
    "reinforce-kl-in-reward": AlgorithmConfig(adv_estimator="reinforce_plus_plus", use_kl_in_reward=True),
    "grpo-decoupled-token-tis": AlgorithmConfig(rollout_correction=RolloutCorrectionConfig(mode="decoupled",
                                                                                           threshold=1.5)),
    "grpo-decoupled-geometric-mask": AlgorithmConfig(rollout_correction=RolloutCorrectionConfig(
        mode="decoupled", level="geometric", method="mask", threshold=1.3)),
}


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_each_estimator_on_a_holed_mask_equals_the_episode_with_its_observations_cut_out(name):
    algorithm = ALGORITHMS[name]
    masked = _batch()
    compacted = [_compacted(s) for s in masked]
    m_metrics = compute_advantages(_ctx(algorithm), masked)
    c_metrics = compute_advantages(_ctx(algorithm), compacted)
    assert any(not s.loss_mask.all() for s in masked)
    for s, c in zip(masked, compacted):
        keep = s.loss_mask.astype(bool)
        assert np.allclose(np.asarray(s.advantages)[keep], c.advantages, atol=1e-5), (name, s.id)
        assert not np.asarray(s.advantages)[~keep].any(), "observation tokens carry advantage"
        if algorithm.adv_estimator == "gae":
            assert np.allclose(np.asarray(s.returns)[keep], c.returns, atol=1e-5)
            assert not np.asarray(s.returns)[~keep].any()
    assert m_metrics.keys() == c_metrics.keys()
    for k in m_metrics:
        assert m_metrics[k] == pytest.approx(c_metrics[k], abs=1e-5), k
    # Somewhere the estimator did more than copy the reward: the equality above is not vacuous.
    assert len({round(float(a), 4) for s in compacted for a in s.advantages}) > 3


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_values_on_observation_tokens_change_no_advantage(name):
    rng = random.Random(7)
    a, b = _batch(seed=3), None
    b = [_scrambled(s, rng) for s in a]
    compute_advantages(_ctx(ALGORITHMS[name]), a)
    compute_advantages(_ctx(ALGORITHMS[name]), b)
    for x, y in zip(a, b):
        assert np.allclose(x.advantages, y.advantages, atol=1e-5)


def test_gae_steps_over_an_observation_block_by_hand():
    # Tokens: m0 m1 [o o] m2; reward 1 on m2; gamma 0.5, lam 1. The value after m1 is m2's (the block is skipped).
    rewards = torch.tensor([[0.0, 0.0, 9.0, 9.0, 1.0]])       # the observation tokens' rewards do not count
    values = torch.tensor([[0.2, 0.4, 5.0, -5.0, 0.6]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0]])
    adv, ret = adv_fns.gae_advantages(rewards, values, mask, gamma=0.5, lam=1.0, whiten=False)
    # GAE with lam 1 is the discounted return minus the value: returns 0.25, 0.5, 1 on m0, m1, m2.
    assert torch.allclose(ret, torch.tensor([[0.25, 0.5, 0.0, 0.0, 1.0]]))
    assert torch.allclose(adv, torch.tensor([[0.05, 0.1, 0.0, 0.0, 0.4]]))
    returns = adv_fns.discounted_returns(rewards, mask, gamma=0.5)
    assert torch.allclose(returns, torch.tensor([[0.25, 0.5, 0.0, 0.0, 1.0]]))


def test_whitening_counts_only_masked_tokens():
    x = torch.tensor([[1.0, 100.0, 3.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    out = adv_fns.masked_whiten(x, mask)
    assert torch.allclose(out, torch.tensor([[-1.0, 0.0, 1.0]]), atol=1e-4)


def test_the_sequence_reward_sits_on_the_last_model_token():
    s = _batch()[0]
    s.loss_mask = np.array([1, 1, 0, 0, 1, 0, 0], dtype=np.uint8)
    s.response_ids = np.arange(7, dtype=np.int32)
    s.values = np.zeros(7, dtype=np.float32)
    s.reward = 2.0
    compute_advantages(_ctx(AlgorithmConfig(adv_estimator="gae", whiten_advantages=False)), [s])
    assert np.allclose(s.returns, [2, 2, 0, 0, 2, 0, 0])


def test_sample_metrics_count_model_tokens_and_average_over_them():
    masked = _batch(seed=5)
    compacted = [_compacted(s) for s in masked]
    got, want = sample_metrics(masked), sample_metrics(compacted)
    for key in ("response_length_mean", "response_length_max", "num_tokens", "rollout_vs_trainer/logprob_abs_diff",
                "rollout_vs_trainer/kl", "kl"):
        assert got[key] == pytest.approx(want[key], rel=1e-6), key
    assert got["num_tokens"] == sum(int(s.loss_mask.sum()) for s in masked)
    assert got["num_observation_tokens"] == sum(int((s.loss_mask == 0).sum()) for s in masked) > 0
    assert "num_observation_tokens" not in want


def test_token_mask_is_the_length_mask_times_the_loss_mask():
    a, b = _batch()[:2]
    b.loss_mask = None
    T = max(len(a.response_ids), len(b.response_ids)) + 2
    mask = token_mask([a, b], T)
    assert mask[0, :len(a.response_ids)].tolist() == a.loss_mask.tolist() and not mask[0, len(a.response_ids):].any()
    assert mask[1].tolist() == [1.0] * len(b.response_ids) + [0.0] * (T - len(b.response_ids))


def test_a_sample_record_carries_the_model_token_count_and_the_observation_spans():
    s = _batch()[0]
    s.loss_mask = np.array([1, 1, 0, 0, 1, 0], dtype=np.uint8)
    s.response_ids = np.arange(6, dtype=np.int32)
    record = sample_record(1, s)
    assert record["response_length"] == 6 and record["model_tokens"] == 3
    assert record["observation_spans"] == [[2, 4], [5, 6]]
    assert observation_spans(None) == [] and observation_spans(np.ones(3)) == []
