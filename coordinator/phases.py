"""The phases of one RL step, as functions of a RunContext: what coordinator/loop.py strings together."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import grpc
import numpy as np
import torch

from coordinator import advantages as adv_fns
from coordinator import remote
from coordinator.config import RunConfig
from coordinator.data import Problem, PromptStream, load_problems
from coordinator.pools import ReplicaPool, split_round_robin
from services.common.channel import create_channel
from services.common.errors import Unavailable

log = logging.getLogger("meshrl.coordinator")


class TrainerUnavailable(Exception):
    """The trainer cannot be reached (it died or is restarting): the run pauses instead of failing."""


class GuardedTrainer:
    """The trainer stub, with UNAVAILABLE raised as TrainerUnavailable.

    So the run manager can tell a lost trainer (pause, resume from a checkpoint) from a lost replica
    (the pools retry elsewhere) or a bad request (the run fails).
    """

    def __init__(self, stub, address: str):
        self._stub = stub
        self._address = address

    def __getattr__(self, name: str):
        method = getattr(self._stub, name)

        async def call(*args, **kwargs):
            try:
                return await method(*args, **kwargs)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    raise TrainerUnavailable(f"trainer {self._address} unavailable during {name}: "
                                             f"{e.details()}") from None
                raise

        return call


class PhaseTimer:
    """Wall seconds per phase; phases that run concurrently are timed separately."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    async def run(self, name: str, coro):
        with self(name):
            return await coro


@dataclass
class RunContext:
    """Connections, data and mutable state of one run."""

    run_id: str
    cfg: RunConfig
    run_dir: Path
    rollout: ReplicaPool
    reward: ReplicaPool
    reference: ReplicaPool | None
    trainer_channel: object
    trainer: object
    data: PromptStream
    heldout: list[Problem]
    step: int = 0
    weight_version: int = 0
    kl_coef: float = 0.0
    kl_controller: adv_fns.AdaptiveKLController | None = None
    prefetched: asyncio.Task | None = None
    # DPO runs: pairs, reference cache (coordinator/dpo.py DPOState).
    dpo: object = None
    # The last step's samples, for tests and debugging.
    last_samples: list = field(default_factory=list)

    @property
    def sampling(self) -> remote.Sampling:
        r = self.cfg.rollout
        # With rollout.seed set, each step has its own seed, so a run (and a step retried on another
        # replica) is reproducible; 0 leaves the replicas unseeded.
        seed = 0
        if r.seed is not None:
            seed = ((r.seed * 1_000_003 + self.step + 1) & (2**63 - 1)) or 1
        return remote.Sampling(n=r.n, temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens,
                               stop=list(r.stop), seed=seed)

    async def close(self) -> None:
        if self.prefetched:
            self.prefetched.cancel()
        for pool in (self.rollout, self.reward, self.reference):
            if pool is not None:
                await pool.close()
        await self.trainer_channel.close()


def _pool(role: str, section, stub_factory, token: str | None, registry=None) -> ReplicaPool:
    return ReplicaPool(role, stub_factory, servers=list(section.servers), dns=section.dns,
                       registry=registry if section.registry else None, load_balancer=section.load_balancer,
                       timeout_s=section.timeout_s, token=token)


def _configured(section) -> bool:
    return bool(section.servers or section.dns or section.registry)


async def open_context(run_id: str, cfg: RunConfig, *, registry=None, position: int = 0) -> RunContext:
    """Connects to every pool and the trainer, loads the data; fails early when a pool is empty."""
    token = cfg.server.auth_token.get_secret_value() if cfg.server.auth_token else None
    from services.common.modeling import load_tokenizer

    tokenizer = load_tokenizer(cfg.model.path)
    d = cfg.data
    is_dpo = cfg.algorithm.kind == "dpo"
    # DPO reads preference pairs (coordinator/dpo.py); RL reads prompts with answers.
    problems = [] if is_dpo else load_problems(
        d.train_files, prompt_key=d.prompt_key, answer_key=d.answer_key, tokenizer=tokenizer,
        apply_chat_template=d.apply_chat_template, max_prompt_tokens=d.max_prompt_length)
    heldout = load_problems(d.heldout_files, prompt_key=d.prompt_key, answer_key=d.answer_key, tokenizer=tokenizer,
                            apply_chat_template=d.apply_chat_template) if d.heldout_files else []
    if d.heldout_size:
        heldout = heldout[:d.heldout_size]
    rollout = _pool("rollout", cfg.rollout, remote.rollout_stub, token, registry)
    reward = _pool("reward", cfg.reward, remote.reward_stub, token, registry)
    reference = _pool("reference", cfg.reference, remote.reference_stub, token, registry) \
        if (cfg.reference.servers or cfg.reference.dns or cfg.reference.registry) else None
    if cfg.needs_reference and reference is None:
        raise ValueError("reference.servers: the KL settings need a reference pool, but none is configured")
    if not cfg.trainer.address:
        raise ValueError("trainer.address: no trainer address configured")
    trainer_channel = create_channel(cfg.trainer.address, token=token, timeout=cfg.trainer.timeout_s)
    run_dir = Path(cfg.run.run_dir) / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    ctx = RunContext(run_id, cfg, run_dir, rollout, reward, reference, trainer_channel,
                     GuardedTrainer(remote.trainer_stub(trainer_channel), cfg.trainer.address), PromptStream(problems, seed=d.seed, shuffle=d.shuffle,
                                                                        position=position), heldout)
    a = cfg.algorithm
    ctx.kl_coef = a.kl_coef
    if a.use_kl_in_reward and a.kl_ctrl == "adaptive":
        ctx.kl_controller = adv_fns.AdaptiveKLController(a.kl_coef, a.target_kl, a.kl_horizon)
    if is_dpo:
        from coordinator import dpo

        ctx.dpo = dpo.open_state(cfg, tokenizer, position=position)
        if reference is None and not ctx.dpo.has_precomputed_reference:
            await ctx.close()
            raise ValueError("reference.servers: DPO needs a reference pool unless the dataset carries "
                             "ref_chosen_logprob / ref_rejected_logprob")
        # Rollout and reward pools are optional for DPO (held-out task accuracy uses them).
        rollout = rollout if _configured(cfg.rollout) else None
        reward = reward if _configured(cfg.reward) else None
        ctx.rollout, ctx.reward = rollout, reward
    for pool in (rollout, reward, reference):
        if pool is not None and not await pool.refresh():
            await ctx.close()
            raise ValueError(f"{pool.role}.servers: no healthy {pool.role} replica reachable "
                             f"(tried {sorted(pool.replicas) or 'none configured'})")
    return ctx


# --- generate ------------------------------------------------------------------------------------------

async def generate(ctx: RunContext, problems: Sequence[Problem], sampling: remote.Sampling | None = None
                   ) -> list[remote.Sample]:
    """n samples per prompt, prompts split into contiguous chunks over the healthy rollout replicas.

    Whole groups stay on one replica; a failed chunk is retried on another replica, so no sample
    is lost or duplicated (results are collected per chunk, in order).
    """
    sampling = sampling or ctx.sampling
    await bring_new_replicas_up_to_date(ctx)
    replicas = ctx.rollout.healthy() or await ctx.rollout.refresh()
    if not replicas:
        raise Unavailable(f"rollout pool: no healthy replica (known: {sorted(ctx.rollout.replicas) or 'none'})")
    groups = list(range(len(problems)))
    chunks = split_round_robin(list(zip(problems, groups)), len(replicas))

    async def one(chunk, replica):
        ps, gs = zip(*chunk)
        return await ctx.rollout.call(lambda stub: remote.generate(stub, ps, gs, sampling), prefer=replica)

    results = await asyncio.gather(*(one(c, r) for c, r in zip(chunks, replicas)))
    return [s for chunk in results for s in chunk]


async def bring_new_replicas_up_to_date(ctx: RunContext) -> None:
    """A replica that joined (or restarted) gets the current weights before it serves.

    Each replica is asked itself (a pool call could answer from another one); version 0 is pushed too,
    since a replica that served another run holds other weights under a higher version.
    """
    stale = []
    for rep in ctx.rollout.healthy():
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
        outcome = await remote.push_weights(ctx.trainer, stale)
        for address in stale:
            rep = ctx.rollout.replicas[address]
            if address in outcome.failed:
                rep.healthy = False
            else:
                rep.weight_version = outcome.version


async def refresh_pools(ctx: RunContext) -> None:
    """Re-discovers every pool's replicas and re-checks their health (restarted replicas rejoin)."""
    await asyncio.gather(*(pool.refresh() for pool in (ctx.rollout, ctx.reward, ctx.reference) if pool is not None))


# --- score, reference, old log-probs, values (concurrently) ---------------------------------------------

async def score(ctx: RunContext, samples: list[remote.Sample]) -> None:
    results = await ctx.reward.call(lambda stub: remote.score(stub, samples))
    for s, (value, components) in zip(samples, results):
        if not math.isfinite(value):
            raise ValueError(f"reward for sample {s.id} is not finite ({value})")
        s.reward, s.components = value, components


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
    if a.old_logprobs == "always" or not one_step or a.tis_cap or a.use_kl_in_reward:
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
    if not ctx.cfg.needs_critic:
        return
    out = await remote.values(ctx.trainer, samples)
    for s, v in zip(samples, out):
        s.values = v


async def score_and_measure(ctx: RunContext, samples: list[remote.Sample], timer: PhaseTimer) -> None:
    # Each call builds its request before its first await, one after another on this loop: the model
    # forwards (reference, old log-probs, values) go first, the reward (fast to serve) last.
    await asyncio.gather(timer.run("reference", reference_logprobs(ctx, samples)),
                         timer.run("old_logprobs", old_logprobs(ctx, samples)),
                         timer.run("values", critic_values(ctx, samples)),
                         timer.run("reward", score(ctx, samples)))


# --- advantages ----------------------------------------------------------------------------------------

def length_mask(lengths: Sequence[int], width: int) -> torch.Tensor:
    """[rows, width] float mask, 1 on each row's first lengths[i] positions."""
    return (torch.arange(width) < torch.tensor(lengths).unsqueeze(1)).float()


def padded(rows: Sequence[Sequence[float]], width: int) -> torch.Tensor:
    """Rows of different lengths (each <= width) as one zero-padded float32 [rows, width] tensor. Filled
    through numpy: a batch holds hundreds of rows, and a torch op per row costs several times more."""
    out = np.zeros((len(rows), width), dtype=np.float32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return torch.from_numpy(out)


def compute_advantages(ctx: RunContext, samples: list[remote.Sample]) -> dict[str, float]:
    """Fills per-token advantages (and returns for PPO) with the configured estimator."""
    a = ctx.cfg.algorithm
    n = ctx.cfg.rollout.n
    T = max(len(s.response_ids) for s in samples)
    mask = length_mask([len(s.response_ids) for s in samples], T)
    scores = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    metrics: dict[str, float] = {}
    # Sequence reward sits on the last token; a KL penalty in the reward is spread per token.
    token_rewards = torch.zeros(len(samples), T)
    for i, s in enumerate(samples):
        token_rewards[i, len(s.response_ids) - 1] = s.reward
    if a.use_kl_in_reward:
        kl = padded([s.old_logprobs for s in samples], T) - padded([s.ref_logprobs for s in samples], T)
        token_rewards = token_rewards - ctx.kl_coef * kl * mask
        metrics["kl_coef"] = ctx.kl_coef
        scores = token_rewards.sum(1)
        if ctx.kl_controller is not None:
            ctx.kl_coef = ctx.kl_controller.update(float((kl * mask).sum() / mask.sum()), len(samples))
    if a.adv_estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        grouped = scores.view(-1, n)
        if a.adv_estimator == "grpo":
            seq_adv = adv_fns.grpo_advantages(grouped, norm_by_std=a.norm_adv_by_std).reshape(-1, 1)
            token_adv = seq_adv * mask
        elif a.adv_estimator == "rloo":
            token_adv = adv_fns.rloo_advantages(grouped).reshape(-1, 1) * mask
        else:
            token_adv = adv_fns.reinforce_pp_baseline_advantages(grouped, mask)
    elif a.adv_estimator == "reinforce_plus_plus":
        token_adv = adv_fns.reinforce_pp_advantages(token_rewards, mask, gamma=a.gamma)
    else:  # gae
        values = padded([s.values for s in samples], T)
        token_adv, returns = adv_fns.gae_advantages(token_rewards, values, mask, gamma=a.gamma, lam=a.lam,
                                                    whiten=a.whiten_advantages)
        for i, s in enumerate(samples):
            s.returns = returns[i, :len(s.response_ids)].tolist()
    if a.tis_cap:
        # Truncated importance sampling: reweight by pi_trainer / pi_rollout, capped.
        w = (padded([s.old_logprobs for s in samples], T) - padded([s.rollout_logprobs for s in samples], T)).exp()
        token_adv = token_adv * w.clamp(max=a.tis_cap) * mask
    rows = token_adv.float().numpy()
    for i, s in enumerate(samples):
        s.advantages = rows[i, :len(s.response_ids)]          # float32 views: packed for the trainer as they are
    metrics["advantage_abs_mean"] = float((token_adv.abs() * mask).sum() / mask.sum())
    return metrics


# --- train, weight sync --------------------------------------------------------------------------------

def actor_loss_settings(ctx: RunContext) -> dict:
    a = ctx.cfg.algorithm
    return dict(clip_low=a.clip_ratio_low, clip_high=a.clip_ratio_high, dual_clip=a.clip_ratio_c,
                kl_coef=a.kl_loss_coef if a.use_kl_loss else 0.0, kl_type=a.kl_loss_type,
                entropy_coef=a.entropy_coeff, loss_agg_mode=a.loss_agg_mode, ppo_epochs=a.ppo_epochs,
                mini_batch_size=a.ppo_mini_batch_size, temperature=1.0)


async def train(ctx: RunContext, samples: list[remote.Sample], timer: PhaseTimer) -> dict[str, float]:
    metrics: dict[str, float] = {}
    if ctx.cfg.needs_critic:
        a = ctx.cfg.algorithm
        with timer("train_critic"):
            critic = await remote.train_critic(ctx.trainer, samples, clip_value=a.clip_value,
                                               ppo_epochs=a.ppo_epochs, mini_batch_size=a.ppo_mini_batch_size)
        metrics.update({f"critic/{k}": v for k, v in critic.items()})
    with timer("train"):
        _, actor = await remote.train_actor(ctx.trainer, samples, actor_loss_settings(ctx))
    metrics.update({f"actor/{k}": v for k, v in actor.items()})
    return metrics


async def sync_weights(ctx: RunContext) -> dict[str, float]:
    """Pushes the trainer's new weights to every healthy rollout replica; a failed replica leaves the pool."""
    targets = [r.address for r in ctx.rollout.healthy()]
    outcome = await remote.push_weights(ctx.trainer, targets)
    for address in targets:
        rep = ctx.rollout.replicas[address]
        if address in outcome.failed:
            log.warning("weight sync to %s failed: %s", address, outcome.failed[address])
            rep.healthy = False
        else:
            rep.weight_version = outcome.version
    if len(outcome.failed) == len(targets):
        raise RuntimeError(f"weight sync failed on every rollout replica: {outcome.failed}")
    ctx.weight_version = outcome.version
    gbps = outcome.num_bytes / max(outcome.seconds, 1e-9) / 1e9
    return {"weight_version": float(outcome.version), "weight_sync/gb_per_s": gbps,
            "weight_sync/failed_replicas": float(len(outcome.failed))}


# --- metrics -------------------------------------------------------------------------------------------

def sample_metrics(samples: list[remote.Sample]) -> dict[str, float]:
    rewards = torch.tensor([s.reward for s in samples])
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32)
    correct = [s.components.get("exact_match", s.reward) for s in samples]
    out = {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()) if len(samples) > 1 else 0.0,
           "accuracy": sum(1.0 for c in correct if c >= 1.0) / len(samples),
           "response_length_mean": float(lengths.mean()), "response_length_max": float(lengths.max()),
           "num_samples": float(len(samples)), "num_tokens": float(lengths.sum())}
    names = {k for s in samples for k in s.components}
    for name in sorted(names):
        out[f"reward/{name}"] = sum(s.components.get(name, 0.0) for s in samples) / len(samples)
    T = int(lengths.max())
    mask = length_mask([len(s.response_ids) for s in samples], T)
    ntok = mask.sum()
    roll = padded([s.rollout_logprobs for s in samples], T)
    policy = roll if all(len(s.rollout_logprobs) == len(s.response_ids) for s in samples) else None
    if all(len(s.old_logprobs) for s in samples):
        old = policy = padded([s.old_logprobs for s in samples], T)
        # Rollout engine vs trainer on the same tokens: a broken weight sync shows here at once.
        out["rollout_vs_trainer/logprob_abs_diff"] = float(((roll - old).abs() * mask).sum() / ntok)
        out["rollout_vs_trainer/kl"] = float((((old - roll).exp() - (old - roll) - 1) * mask).sum() / ntok)
    if policy is not None and all(len(s.ref_logprobs) for s in samples):
        # k3 estimate of KL(policy || reference); the policy's log-probs are the trainer's old ones when
        # computed this step, else the rollout engine's (equal to them up to the parity metric above).
        ref = padded([s.ref_logprobs for s in samples], T)
        out["kl"] = float((((ref - policy).exp() - (ref - policy) - 1) * mask).sum() / ntok)
    return out


def write_jsonl(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


async def evaluate(ctx: RunContext) -> float:
    """Held-out accuracy with greedy decoding through the rollout and reward pools."""
    if not ctx.heldout or ctx.rollout is None or ctx.reward is None:
        return float("nan")
    greedy = remote.Sampling(n=1, temperature=0.0, top_p=1.0, max_tokens=ctx.cfg.rollout.max_tokens,
                             stop=list(ctx.cfg.rollout.stop))
    samples = await generate(ctx, ctx.heldout, greedy)
    await score(ctx, samples)
    correct = [s.components.get("exact_match", s.reward) for s in samples]
    return sum(1.0 for c in correct if c >= 1.0) / len(samples)
