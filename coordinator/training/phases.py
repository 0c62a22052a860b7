"""The phases of one RL step, as functions of a RunContext: what coordinator/training/loop.py strings together
(what a step reports, and held-out evaluation, are in reporting.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from typing import Sequence

import grpc
import numpy as np
import torch

from coordinator.recipe import run_settings
from coordinator.recipe.config import distill_coef, rollout_correction
from coordinator.recipe.data import Problem
from coordinator.training import advantages as adv_fns
from coordinator.training import remote
from coordinator.training import rollout_correction as rc_math
from coordinator.training.context import PhaseTimer, RunContext
from coordinator.training.episodes import wants_episodes
from services.common.errors import Unavailable
from services.common.rpc.pools import split_round_robin
from services.rollout.types import SamplingParams

log = logging.getLogger("meshrl.coordinator")


# --- generate ------------------------------------------------------------------------------------------

async def generate(ctx: RunContext, problems: Sequence[Problem], sampling: SamplingParams | None = None, *,
                   partial_rollout: str = "off") -> list[remote.Sample]:
    """n samples per prompt, prompts split into contiguous chunks over the healthy rollout replicas.

    Whole groups stay on one replica; a failed chunk is retried on another replica, so no sample
    is lost or duplicated (results are collected per chunk, in order). partial_rollout: weight updates may land
    while these samples decode (coordinator/training/async_rollouts.py).
    """
    sampling = sampling or ctx.sampling
    await bring_new_replicas_up_to_date(ctx)
    replicas = await ctx.rollout.wait_for_replica()
    if not replicas:
        raise Unavailable(f"rollout pool: no healthy replica (known: {sorted(ctx.rollout.replicas) or 'none'})")
    groups = list(range(len(problems)))
    chunks = split_round_robin(list(zip(problems, groups)), len(replicas))

    async def one(chunk, replica):
        ps, gs = zip(*chunk)

        async def generate_on(stub):
            # the replica that answers (the pool may have moved the chunk off `replica`) and the adapter it serves
            rep = next((r for r in ctx.rollout.replicas.values() if r.stub is stub), None)
            on = dataclasses.replace(sampling, adapter=rep.adapter) if rep is not None and rep.adapter else sampling
            if wants_episodes(ctx.cfg.rollout.agent, ps):   # multi-turn: played in the replica
                samples = await remote.generate_episodes(stub, ps, gs, on, ctx.cfg.rollout.agent,
                                                         partial_rollout=partial_rollout)
            else:
                samples = await remote.generate(stub, ps, gs, on, partial_rollout=partial_rollout)
            for s in samples:
                s.replica = rep.address if rep is not None else ""
            return samples

        return await ctx.rollout.call(generate_on, prefer=replica)

    results = await asyncio.gather(*(one(c, r) for c, r in zip(chunks, replicas)))
    return [s for chunk in results for s in chunk]


async def bring_new_replicas_up_to_date(ctx: RunContext) -> None:
    """A replica that joined (or restarted) gets the current weights before it serves.

    Each replica is asked itself (a pool call could answer from another one); version 0 is pushed too,
    since a replica that served another run holds other weights under a higher version. Calls wait for each
    other (ctx.catch_up): batches generated together find the replica stale at once, and each pushing would
    send the weights again, the later ones after a step may have trained (a batch launched at version 0 would
    then start on the next version's weights).
    """
    async with ctx.catch_up:
        stale = []
        for rep in ctx.rollout.healthy():
            if ctx.adapter and not rep.adapter:
                # A run beside others: a replica never given its named adapter would answer with another run's
                # weights whatever version it reports.
                stale.append(rep.address)
                continue
            if rep.weight_version != ctx.weight_version:
                try:
                    info = await remote.info(rep.stub)
                except grpc.aio.AioRpcError as e:
                    log.warning("rollout pool: %s did not answer GetInfo (%s); leaving it out", rep.address,
                                e.code().name)
                    rep.healthy = False
                    continue
                rep.weight_version = info.weight_version
                if rep.weight_version != ctx.weight_version:
                    stale.append(rep.address)
        if stale:
            log.info("pushing weights v%d to %s", ctx.weight_version, stale)
            await push_to_replicas(ctx, stale)


async def push_to_replicas(ctx: RunContext, targets: list[str]) -> remote.PushOutcome:
    """The trainer's weights to `targets`: each replica's version is the pushed one, or it leaves the pool."""
    outcome = await remote.push_weights(ctx.trainer, targets)
    for address in targets:
        rep = ctx.rollout.replicas[address]
        if address in outcome.failed:
            log.warning("weight sync to %s failed: %s", address, outcome.failed[address])
            rep.healthy = False
        else:
            rep.weight_version = outcome.version
            rep.adapter = outcome.adapters.get(address, "")
    return outcome


async def unload_run_adapter(ctx: RunContext) -> None:
    """The trainer's own adapter leaves the rollout replicas (UnloadAdapter) when its run ends beside other runs, so
    its slot is free for the next run's named adapter; a run that takes the trainer's adapter again pushes it anew
    (its start moves the version past every earlier one). A replica that cannot be reached keeps it until it
    restarts."""

    async def one(rep) -> None:
        try:
            await remote.unload_adapter(rep.stub, rep.adapter)
            rep.adapter = ""
        except Exception as e:  # noqa: BLE001 - that replica keeps the slot; the run still ends
            log.warning("UnloadAdapter %r on %s failed: %s", rep.adapter, rep.address, e)

    if ctx.rollout is not None:
        await asyncio.gather(*(one(r) for r in ctx.rollout.replicas.values() if r.adapter))


async def refresh_pools(ctx: RunContext) -> None:
    """Re-discovers every pool's replicas and re-checks their health (restarted replicas rejoin)."""
    await asyncio.gather(*(pool.refresh() for pool in (ctx.rollout, ctx.reward, ctx.reference) if pool is not None))


# --- score, reference, old log-probs, values (concurrently) ---------------------------------------------

async def score(ctx: RunContext, samples: list[remote.Sample]) -> None:
    """Fills each sample's reward, components and extra keys; a sample the reward failed on keeps its error
    (recorded as failed, not as 0; it trains on nothing). Every sample failing fails the step."""
    components = run_settings.score_components(ctx.cfg)
    results = await ctx.reward.call(lambda stub: remote.score(stub, samples, components))
    for s, r in zip(samples, results):
        if not r.error and not math.isfinite(r.score):
            raise ValueError(f"reward for sample {s.id} is not finite ({r.score})")
        s.reward, s.components, s.reward_extras, s.reward_error = r.score, r.components, r.extras, r.error
    failed = [s for s in samples if s.reward_error]
    if failed:
        log.warning("reward failed on %d of %d samples; the first: %s", len(failed), len(samples),
                    failed[0].reward_error)
    if len(failed) == len(samples):
        raise ValueError(f"reward: every sample of the batch failed to score; the first: {failed[0].reward_error}")


def fill_failed_rewards(samples: list[remote.Sample]) -> None:
    """A failed sample takes the mean reward of its group's scored samples (0 if none), so it moves no group
    statistic; its advantages are zeroed after the estimator (it trains on nothing)."""
    by_group: dict[int, list[float]] = {}
    for s in samples:
        if not s.reward_error:
            by_group.setdefault(s.group, []).append(s.reward)
    for s in samples:
        if s.reward_error:
            scored = by_group.get(s.group)
            s.reward = sum(scored) / len(scored) if scored else 0.0


async def reference_logprobs(ctx: RunContext, samples: list[remote.Sample]) -> None:
    if ctx.reference is None:
        return
    out = await ctx.reference.call(lambda stub: remote.logprobs(stub, samples))
    for s, lp in zip(samples, out):
        s.ref_logprobs = lp


def needs_old_logprobs(ctx: RunContext, num_samples: int) -> bool:
    """Whether this step computes old log-probs on the trainer (see algorithm.old_logprobs)."""
    a = ctx.cfg.algorithm
    one_step = a.ppo_epochs == 1 and (a.ppo_mini_batch_size == 0 or a.ppo_mini_batch_size >= num_samples)
    decoupled = rollout_correction(a).mode == "decoupled"
    if a.old_logprobs == "always" or not one_step or decoupled or a.use_kl_in_reward:
        return True
    # ctx.step counts finished steps: this is step ctx.step + 1.
    every = a.logprob_parity_every
    return every > 0 and (ctx.step == 0 or (ctx.step + 1) % every == 0)


async def old_logprobs(ctx: RunContext, samples: list[remote.Sample]) -> None:
    if not needs_old_logprobs(ctx, len(samples)):
        return
    out = await remote.logprobs(ctx.trainer, samples)
    for s, lp in zip(samples, out):
        s.old_logprobs = lp


async def critic_values(ctx: RunContext, samples: list[remote.Sample]) -> None:
    if not estimator(ctx).needs_critic:
        return
    out = await remote.values(ctx.trainer, samples)
    for s, v in zip(samples, out):
        s.values = v


async def score_and_measure(ctx: RunContext, samples: list[remote.Sample], timer: PhaseTimer, *,
                            scored: bool = False) -> None:
    """The reward (and the overlong penalty) and the model forwards of a batch; `scored`: the reward is in already
    (dynamic sampling scores each generation batch first, coordinator/training/dynamic_sampling.py)."""
    # Each call builds its request before its first await, one after another on this loop: the model
    # forwards (reference, old log-probs, values) go first, the reward (fast to serve) last.
    await asyncio.gather(timer.run("reference", reference_logprobs(ctx, samples)),
                         timer.run("old_logprobs", old_logprobs(ctx, samples)),
                         timer.run("values", critic_values(ctx, samples)),
                         *([] if scored else [timer.run("reward", score_shaped(ctx, samples))]))


async def score_shaped(ctx: RunContext, samples: list[remote.Sample]) -> None:
    """The training reward: the reward pool's score plus algorithm.overlong_buffer's penalty."""
    await score(ctx, samples)
    ob = ctx.cfg.algorithm.overlong_buffer
    if not ob.enable:
        return
    for s in samples:
        if s.episode:
            raise ValueError("algorithm.overlong_buffer.enable: measures one response against rollout.max_tokens; "
                             f"sample {s.id} is a multi-turn episode")
        if not s.reward_error:
            s.overlong_penalty = overlong_penalty(num_model_tokens(s), ctx.cfg.rollout.max_tokens, ob.len,
                                                  ob.penalty_factor)
            s.reward += s.overlong_penalty


def overlong_penalty(length: int, max_len: int, buffer_len: int, factor: float) -> float:
    """DAPO's soft overlong punishment (verl's reward_model.overlong_buffer): 0 up to max_len - buffer_len tokens,
    then falling linearly to -factor at max_len."""
    over = length - (max_len - buffer_len)
    return -min(1.0, max(0.0, over / buffer_len)) * factor


# --- advantages ----------------------------------------------------------------------------------------

def length_mask(lengths: Sequence[int], width: int) -> torch.Tensor:
    """[rows, width] float mask, 1 on each row's first lengths[i] positions."""
    return (torch.arange(width) < torch.tensor(lengths).unsqueeze(1)).float()


def token_mask(samples: Sequence[remote.Sample], width: int) -> torch.Tensor:
    """[rows, width] float mask of the tokens each sample's model sampled: its first len(response_ids) positions,
    less the observation tokens of a multi-turn episode (Sample.loss_mask 0). Advantages, the KL in the reward,
    whitening, rollout correction and every per-token metric run over these only."""
    mask = length_mask([len(s.response_ids) for s in samples], width)
    if any(s.loss_mask is not None for s in samples):
        mask = mask * padded([np.ones(len(s.response_ids), np.float32) if s.loss_mask is None else s.loss_mask
                              for s in samples], width)
    return mask


def num_model_tokens(s: remote.Sample) -> int:
    """Response tokens the model sampled (all of them unless a loss mask marks observation tokens)."""
    return len(s.response_ids) if s.loss_mask is None else int(np.count_nonzero(s.loss_mask))


def last_model_token(s: remote.Sample) -> int:
    """Where the sequence reward sits: the last token the model sampled (an episode may end on an observation)."""
    if s.loss_mask is not None and np.count_nonzero(s.loss_mask):
        return int(np.flatnonzero(s.loss_mask)[-1])
    return len(s.response_ids) - 1


def padded(rows: Sequence[Sequence[float]], width: int) -> torch.Tensor:
    """Rows of different lengths (each <= width) as one zero-padded float32 [rows, width] tensor. Filled
    through numpy: a batch holds hundreds of rows, and a torch op per row costs several times more."""
    out = np.zeros((len(rows), width), dtype=np.float32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return torch.from_numpy(out)


def estimator(ctx: RunContext) -> adv_fns.Estimator:
    return adv_fns.ADVANTAGE_ESTIMATORS[ctx.cfg.algorithm.adv_estimator]


def compute_advantages(ctx: RunContext, samples: list[remote.Sample]) -> dict[str, float]:
    """Fills per-token advantages (and returns for PPO) with the configured estimator, over the model's tokens
    (observation tokens of an episode get advantage 0 and return 0)."""
    a = ctx.cfg.algorithm
    fill_failed_rewards(samples)
    T = max(len(s.response_ids) for s in samples)
    mask = token_mask(samples, T)
    # Groups with no reward variance train on nothing (coordinator/recipe/no_signal.py warns when all of them do).
    metrics = {"train/frac_zero_adv_groups": adv_fns.zero_variance_fraction(
        torch.tensor([s.reward for s in samples]), torch.tensor([s.group for s in samples]))}
    # Sequence reward sits on the last model token; a KL penalty in the reward is spread per model token.
    token_rewards = torch.zeros(len(samples), T)
    for i, s in enumerate(samples):
        token_rewards[i, last_model_token(s)] = s.reward
    if a.use_kl_in_reward:
        old, ref = padded([s.old_logprobs for s in samples], T), padded([s.ref_logprobs for s in samples], T)
        token_rewards = token_rewards + adv_fns.kl_reward_penalty(old, ref, ctx.kl_coef) * mask
        metrics["kl_coef"] = ctx.kl_coef
        if ctx.kl_controller is not None:
            ctx.kl_coef = ctx.kl_controller.update(float(((old - ref) * mask).sum() / mask.sum()), len(samples))
    batch = adv_fns.AdvantageBatch(token_rewards, mask, torch.tensor([s.group for s in samples]),
                                   padded([s.values for s in samples], T) if estimator(ctx).needs_critic else None)
    token_adv, returns = estimator(ctx).fn(batch, a)
    if distill_coef(a) > 0:
        distilled, distill_metrics = distill_term(samples, mask, distill_coef(a))
        token_adv = token_adv + distilled
        metrics.update(distill_metrics)
    if returns is not None:
        for i, s in enumerate(samples):
            s.returns = returns[i, :len(s.response_ids)].tolist()
    weights, corr_metrics = correction(ctx, samples, mask)
    metrics.update(corr_metrics)
    if weights is not None:
        token_adv = token_adv * weights
    scored = torch.tensor([not s.reward_error for s in samples], dtype=token_adv.dtype)
    rows = (token_adv * scored.unsqueeze(1)).float().numpy()
    for i, s in enumerate(samples):
        s.advantages = rows[i, :len(s.response_ids)]          # float32 views: packed for the trainer as they are
    metrics["advantage_abs_mean"] = float((token_adv.abs() * mask).sum() / mask.sum())
    return metrics


def distill_term(samples: list[remote.Sample], mask: torch.Tensor, coef: float):
    """On-policy distillation's advantages [B, T] (adv_fns.distill_advantages: the student's rollout log-probs
    against the teacher's, which the reference replicas computed) and their `distill/` metrics."""
    T = mask.shape[1]
    for s in samples:
        if len(s.rollout_logprobs) != len(s.response_ids) or len(s.ref_logprobs) != len(s.response_ids):
            raise ValueError(f"algorithm.distill_kl_coef: sample {s.id} lacks the student's rollout log-probs or "
                             f"the teacher's (reference) log-probs of its {len(s.response_ids)} response tokens")
    student, teacher = padded([s.rollout_logprobs for s in samples], T), padded([s.ref_logprobs for s in samples], T)
    n = mask.sum().clamp(min=1.0)
    reverse_kl = ((student - teacher) * mask).sum() / n
    return adv_fns.distill_advantages(student, teacher, mask, coef), {
        "distill/reverse_kl": float(reverse_kl), "distill/teacher_logprob": float((teacher * mask).sum() / n),
        "distill/kl_coef": coef}


def correction(ctx: RunContext, samples: list[remote.Sample], mask: torch.Tensor):
    """algorithm.rollout_correction: (weights [B, T] for the advantages, or None, and the `rollout_corr/`
    metrics). Decoupled mode weights every step; bypass mode only measures, on the steps whose trainer old
    log-probs were computed (its update takes the rollout log-probs as the old policy, see `train`)."""
    rc = rollout_correction(ctx.cfg.algorithm)
    T = mask.shape[1]
    have_old = all(len(s.old_logprobs) == len(s.response_ids) for s in samples)
    if rc.mode == "off" or not have_old or not all(len(s.rollout_logprobs) == len(s.response_ids) for s in samples):
        return None, {}
    old, roll = padded([s.old_logprobs for s in samples], T), padded([s.rollout_logprobs for s in samples], T)
    weights, raw = rc_math.correction_weights(old, roll, mask, level=rc.level, method=rc.method,
                                              threshold=rc.threshold, threshold_low=rc.threshold_low,
                                              veto_threshold=rc.veto_threshold)
    metrics = rc_math.correction_metrics(old, roll, mask, weights, raw, level=rc.level, method=rc.method,
                                         threshold=rc.threshold, veto_threshold=rc.veto_threshold)
    return (weights if rc.mode == "decoupled" else None), metrics


def policy_samples(ctx: RunContext, samples: list[remote.Sample]) -> list[remote.Sample]:
    """What TrainActor trains on: in bypass mode the rollout log-probs stand in as the old policy (0.0 on an
    episode's observation tokens, which the loss mask keeps out of every loss term; the mask rides along)."""
    if rollout_correction(ctx.cfg.algorithm).mode != "bypass":
        return samples
    return [dataclasses.replace(s, old_logprobs=s.rollout_logprobs) for s in samples]


# --- train, weight sync --------------------------------------------------------------------------------

async def train(ctx: RunContext, samples: list[remote.Sample], timer: PhaseTimer,
                sent: dict[str, float] | None = None) -> dict[str, float]:
    metrics: dict[str, float] = {}
    # Recorded by the trainer as this step, with the data position after it (advanced by the caller) and the
    # step's metrics measured so far (`sent`). The critic goes first: an actor update on record means the step's
    # critic update is too (coordinator/runapi/recovery.py).
    run_step = remote.RunStep(ctx.run_id, ctx.step + 1, ctx.data.position, dict(sent or {}))
    if estimator(ctx).needs_critic:
        with timer("train_critic"):
            critic = await remote.train_critic(ctx.trainer, samples, ctx.losses.critic, run_step)
        metrics.update({f"critic/{k}": v for k, v in critic.items()})
    with timer("train"):
        _, actor = await remote.train_actor(ctx.trainer, policy_samples(ctx, samples), ctx.losses.actor, run_step)
    metrics.update({f"actor/{k}": v for k, v in actor.items()})
    return metrics


async def sync_weights(ctx: RunContext) -> dict[str, float]:
    """Pushes the trainer's new weights to every healthy rollout replica; a failed replica leaves the pool."""
    targets = [r.address for r in ctx.rollout.healthy()]
    outcome = await push_to_replicas(ctx, targets)
    if len(outcome.failed) == len(targets):
        raise RuntimeError(f"weight sync failed on every rollout replica: {outcome.failed}")
    ctx.weight_version = outcome.version
    gbps = outcome.num_bytes / max(outcome.seconds, 1e-9) / 1e9
    # bytes: the payload the trainer sent (under actor.lora, to replicas serving adapters: the adapter alone);
    # seconds: the trainer's whole push, every replica's stream included.
    return {"weight_version": float(outcome.version), "weight_sync/gb_per_s": gbps,
            "weight_sync/bytes": float(outcome.num_bytes), "weight_sync/seconds": float(outcome.seconds),
            "weight_sync/failed_replicas": float(len(outcome.failed))}
