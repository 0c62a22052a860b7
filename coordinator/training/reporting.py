"""What an RL step reports and how the run is evaluated: the step's reward, accuracy, replica, length and KL
metrics, its samples.jsonl lines, and held-out evaluation (greedy generation scored by the run's own reward)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from coordinator.training import phases, remote
from coordinator.training.context import RunContext
from coordinator.training.episodes import episode_metrics


def success(s: remote.Sample) -> float:
    """How right a scored sample is by the run's own reward, as verl's validation reads it: the `acc` its reward
    function returned, when it returns one, else its reward (the recipe's weighted components, as training
    scores them: 1.0 or 0.0 under an exact_match recipe, so the mean is the fraction right), without the
    coordinator's overlong penalty."""
    acc = s.reward_extras.get("acc")
    return float(acc) if acc is not None else s.reward - s.overlong_penalty


def reward_metrics(samples: list[remote.Sample]) -> dict[str, float]:
    """Reward, accuracy, components and the reward functions' extra keys, over the samples that scored;
    `num_reward_failed` counts those that did not."""
    scored = [s for s in samples if not s.reward_error] or samples[:0]
    rewards = torch.tensor([s.reward for s in scored], dtype=torch.float32)
    out = {"reward_mean": float(rewards.mean()) if scored else math.nan,
           "reward_std": float(rewards.std()) if len(scored) > 1 else 0.0,
           "accuracy": sum(success(s) for s in scored) / max(len(scored), 1),
           "num_reward_failed": float(len(samples) - len(scored))}
    for name in sorted({k for s in scored for k in s.components}):
        out[f"reward/{name}"] = sum(s.components.get(name, 0.0) for s in scored) / len(scored)
    for name in sorted({k for s in scored for k in s.reward_extras}):
        values = [s.reward_extras[name] for s in scored if name in s.reward_extras]
        out[f"reward_extra/{name}"] = sum(values) / len(values)
    return out


def replica_metrics(samples: list[remote.Sample]) -> dict[str, float]:
    """Per rollout replica (host:port): the samples it generated this step and the oldest weight version they
    came from, so a replica that joined mid-run shows its share and that it served current weights."""
    out: dict[str, float] = {}
    for s in samples:
        if s.replica:
            out[f"rollout/samples/{s.replica}"] = out.get(f"rollout/samples/{s.replica}", 0.0) + 1.0
            key = f"rollout/weight_version/{s.replica}"
            out[key] = min(out.get(key, math.inf), float(s.weight_version))
    return out


def sample_metrics(samples: list[remote.Sample]) -> dict[str, float]:
    """The step's sample metrics; lengths count the model's tokens and per-token means run over them only (an
    episode's observation tokens are in `num_observation_tokens`)."""
    lengths = torch.tensor([phases.num_model_tokens(s) for s in samples], dtype=torch.float32)
    out = {**reward_metrics(samples), **replica_metrics(samples), **episode_metrics(samples),
           "response_length_mean": float(lengths.mean()), "response_length_max": float(lengths.max()),
           "num_samples": float(len(samples)), "num_tokens": float(lengths.sum())}
    cached = sum(s.cached_prompt_tokens for s in samples)
    if cached:       # rollout.kv_cache paged: the share of the step's prompt tokens its replicas did not prefill
        out["rollout/prompt_tokens_cached_frac"] = cached / max(sum(len(s.prompt_ids) for s in samples), 1)
    T = max(len(s.response_ids) for s in samples)
    mask = phases.token_mask(samples, T)
    ntok = mask.sum().clamp(min=1.0)
    if any(s.loss_mask is not None for s in samples):
        out["num_observation_tokens"] = float(sum(len(s.response_ids) for s in samples) - lengths.sum())
    roll = phases.padded([s.rollout_logprobs for s in samples], T)
    policy = roll if all(len(s.rollout_logprobs) == len(s.response_ids) for s in samples) else None
    if all(len(s.old_logprobs) for s in samples):
        old = policy = phases.padded([s.old_logprobs for s in samples], T)
        # Rollout engine vs trainer on the same tokens: a broken weight sync shows here at once.
        out["rollout_vs_trainer/logprob_abs_diff"] = float(((roll - old).abs() * mask).sum() / ntok)
        out["rollout_vs_trainer/kl"] = float((((old - roll).exp() - (old - roll) - 1) * mask).sum() / ntok)
    if policy is not None and all(len(s.ref_logprobs) for s in samples):
        # k3 estimate of KL(policy || reference); the policy's log-probs are the trainer's old ones when
        # computed this step, else the rollout engine's (equal to them up to the parity metric above).
        ref = phases.padded([s.ref_logprobs for s in samples], T)
        out["kl"] = float((((ref - policy).exp() - (ref - policy) - 1) * mask).sum() / ntok)
    return out


def write_jsonl(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def sample_record(step: int, s: remote.Sample) -> dict:
    """One line of samples.jsonl: the sample, its score (or why it failed) and every field of its row."""
    p = s.problem
    return {"step": step, "id": s.id, "prompt": p.prompt, "response": s.text, "finish_reason": s.finish_reason,
            "response_length": len(s.response_ids), "model_tokens": phases.num_model_tokens(s),
            "observation_spans": observation_spans(s.loss_mask), "ground_truth": p.ground_truth,
            "data_source": p.data_source,
            "ability": p.ability, "reward_style": p.reward_style, "extra_info": p.extra_info,
            "reward": None if s.reward_error else s.reward, "reward_failed": bool(s.reward_error),
            "reward_error": s.reward_error, "overlong_penalty": s.overlong_penalty, "components": s.components, "reward_extras": s.reward_extras,
            "weight_version": s.weight_version, **({"episode": s.episode} if s.episode else {}),
            # Partial rollouts: per token, the weight version that produced it (only when several did).
            **({"weight_versions": [int(v) for v in s.weight_versions]} if s.weight_versions is not None else {})}


def observation_spans(loss_mask) -> list[list[int]]:
    """[start, end) response-token ranges of the observation tokens (loss mask 0); [] when every token is the
    model's. With response_length this is the whole mask, in a line a person can read."""
    if loss_mask is None:
        return []
    obs = np.concatenate([[0], (np.asarray(loss_mask) == 0).astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(obs))
    return edges.reshape(-1, 2).tolist()


def write_samples(ctx: RunContext, samples: list[remote.Sample]) -> None:
    """The step's samples to <run_dir>/samples.jsonl (run.save_samples)."""
    if not ctx.cfg.run.save_samples:
        return
    with (ctx.run_dir / "samples.jsonl").open("a") as f:
        for s in samples:
            f.write(json.dumps(sample_record(ctx.step, s), default=str) + "\n")


async def evaluate(ctx: RunContext) -> dict[str, float]:
    """Held-out metrics of greedy generations, scored by the run's own reward through the same reward pool call
    as a training step: `heldout_accuracy` (the mean success; a sample whose score failed counts 0) and
    `heldout_reward/<component>` (each component unweighted, over the samples that scored)."""
    if not ctx.heldout or ctx.rollout is None or ctx.reward is None:
        return {"heldout_accuracy": math.nan}
    greedy = ctx.cfg.rollout.sampling(n=1, temperature=0.0, top_p=1.0, seed=None)
    samples = await phases.generate(ctx, ctx.heldout, greedy)
    await phases.score(ctx, samples)
    scored = [s for s in samples if not s.reward_error]
    out = {"heldout_accuracy": sum(success(s) for s in scored) / len(samples)}
    for name in sorted({k for s in scored for k in s.components}):
        out[f"heldout_reward/{name}"] = sum(s.components.get(name, 0.0) for s in scored) / len(scored)
    return out
