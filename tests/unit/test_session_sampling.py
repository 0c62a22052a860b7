"""A session the replica opens for its own episode samples with the run's settings, its adapter included: the
agent's requests (OpenAI chat in proxy mode) name no adapter, and the run's LoRA adapter must still apply."""

from __future__ import annotations

from services.rollout.agents.sessions import Session
from services.rollout.types import AgentLimits, SamplingParams


def test_an_episode_session_samples_under_the_runs_adapter_not_the_requests_base():
    run = SamplingParams(n=1, temperature=0.7, top_p=0.9, max_tokens=64, seed=5, adapter="run-a")
    session = Session("s1", sampling=run, limits=AgentLimits(max_total_tokens=100, max_tokens_per_turn=32))
    asked = SamplingParams(n=1, temperature=1.0, max_tokens=48)
    got = session._sampling(asked, plan=type("Plan", (), {"segment": None})())
    assert (got.adapter, got.temperature, got.top_p, got.seed, got.max_tokens) == ("run-a", 0.7, 0.9, 5, 32)


def test_a_plain_session_keeps_the_requests_sampling():
    asked = SamplingParams(n=1, max_tokens=48, adapter="")
    assert Session("s2")._sampling(asked, plan=None) is asked
