"""Multi-turn episodes on the coordinator's side: when a step's prompts are played as episodes (GenerateEpisodes on
the rollout replicas) and the episode metrics of a step."""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from coordinator.recipe.data import Problem
from services.rollout.config import AgentConfig


def wants_episodes(agent: AgentConfig, problems: Sequence[Problem]) -> bool:
    """The run names an agent loop (`rollout.agent.name`), or a row picks one (verl's `agent_name`)."""
    return agent.name is not None or any(p.agent_name for p in problems)


def episode_metrics(samples: Sequence) -> dict[str, float]:
    """Per step, over the samples that were episodes: turns and tool calls per episode, the share of tool calls
    that failed, and the share of episodes that ended for each reason (`end_reason/<reason>`)."""
    episodes = [s.episode for s in samples if s.episode]
    if not episodes:
        return {}
    n = len(episodes)
    calls = sum(e["num_tool_calls"] for e in episodes)
    out = {"turns_per_episode": sum(e["num_turns"] for e in episodes) / n,
           "tool_calls_per_episode": calls / n,
           "tool_error_rate": sum(e["num_tool_errors"] for e in episodes) / calls if calls else 0.0}
    rewards = [e["env_reward"] for e in episodes if "env_reward" in e]
    if rewards:
        out["env_reward_mean"] = sum(rewards) / len(rewards)
    for reason, count in sorted(Counter(e["end_reason"] for e in episodes).items()):
        out[f"end_reason/{reason}"] = count / n
    return out
