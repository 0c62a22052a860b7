"""The RL loop over the mesh (GRPO, PPO, RLOO, REINFORCE++). Reads top to bottom: generate -> score ||
reference || old logprobs || values -> advantages -> train -> sync weights -> record. Details live in
coordinator/training/phases.py; `RL` at the bottom is this family's entry in coordinator/training/algorithms.py."""

from __future__ import annotations

import time

from coordinator.recipe.config import RunConfig
from coordinator.recipe.data import PromptStream, load_dataset
from coordinator.training import async_rollouts, dynamic_sampling, faults, phases, reporting
from coordinator.training.context import Algorithm, PhaseTimer, RunContext


async def rl_step(ctx: RunContext) -> dict[str, float]:
    """One on-policy (or, in async mode, bounded-staleness) step; returns its metrics."""
    timer = PhaseTimer()
    start = time.perf_counter()
    batch_size = ctx.cfg.data.rollout_batch_size

    # Generate -> score || reference || old logprobs || values; under algorithm.filter_groups, generate -> score ->
    # keep the groups with reward variance, until the batch is full (several generation batches), then the rest.
    samples, gen_metrics, consumed = await dynamic_sampling.generate_and_score(ctx, batch_size, timer)
    adv_metrics = phases.compute_advantages(ctx, samples)
    measured = {**reporting.sample_metrics(samples), **adv_metrics, **gen_metrics}

    # Before the update: the trainer records the data position after it with the step (services/trainer/steps.py);
    # it moves past every prompt the step generated, dropped groups included. The trainer also keeps what was
    # measured so far, for a coordinator that dies before its commit (runapi/recovery.py).
    ctx.data.advance(consumed)
    # Async mode: the ledger says which groups this step trains on before the update; its commit marks them trained.
    await async_rollouts.stage_step(ctx, samples)
    sent = {**measured, **_data_metrics(ctx), **{f"time/{k}": v for k, v in timer.seconds.items()}}
    train_metrics = await phases.train(ctx, samples, timer, sent=sent)
    faults.kill_point("after_train", ctx.step + 1)
    with timer("weight_sync"):
        sync_metrics = await phases.sync_weights(ctx)
    faults.kill_point("after_sync", ctx.step + 1)

    ctx.step += 1
    ctx.last_samples = samples
    reporting.write_samples(ctx, samples)
    seconds = time.perf_counter() - start
    return {**measured, **train_metrics, **sync_metrics, **{f"time/{k}": v for k, v in timer.seconds.items()},
            "time/step": seconds, "samples_per_s": len(samples) / seconds, **_data_metrics(ctx)}


def _data_metrics(ctx: RunContext) -> dict[str, float]:
    return {"data_position": float(ctx.data.position), "epoch": float(ctx.data.epoch),
            "data/num_overlong_dropped": float(ctx.data.num_dropped)}


async def evaluate(ctx: RunContext) -> dict[str, float]:
    """Held-out task metrics, greedy, scored by the run's reward."""
    return await reporting.evaluate(ctx)


def load_prompts(cfg: RunConfig, tokenizer, position: int) -> tuple[PromptStream, None]:
    """The training prompts (with their answers for the reward) as a seeded stream at `position`; a data_source
    the reward has nothing for is refused here, before step 1."""
    d = cfg.data
    ds = load_dataset(d.train_files, key="data.train_files", prompt_key=d.prompt_key, answer_key=d.answer_key,
                      reward_fn_key=d.reward_fn_key, tokenizer=tokenizer, apply_chat_template=d.apply_chat_template,
                      max_prompt_tokens=d.max_prompt_length, filter_overlong=d.filter_overlong_prompts)
    cfg.reward.check_data_sources(ds.sources)
    return PromptStream(ds.problems, seed=d.seed, shuffle=d.shuffle, position=position,
                        num_dropped=ds.num_overlong_dropped), None


def reference_needed(cfg: RunConfig, state) -> str:
    return ("the KL settings (or distillation's teacher) need a reference pool, but none is configured"
            if cfg.needs_reference else "")


RL = Algorithm(load=load_prompts, step=rl_step, evaluate=evaluate, reference_needed=reference_needed)
