"""DPO through the mesh: preference pairs, reference log-probs (cached per pair), TrainDPO, preference accuracy.
`DPO` at the bottom is this family's entry in coordinator/training/algorithms.py."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

from coordinator.recipe.config import RunConfig
from coordinator.recipe.data import PromptStream, read_rows, _lookup
from coordinator.training import remote, reporting
from coordinator.training.context import Algorithm, PhaseTimer, RunContext


@dataclass
class Pair:
    """One tokenized preference pair; reference sums are filled from the dataset or the reference pool."""

    id: str
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    ref_chosen: float | None = None
    ref_rejected: float | None = None


@dataclass
class DPOState:
    """What a DPO run keeps beside its training stream of pairs (RunContext.state)."""

    heldout: list[Pair]
    has_precomputed_reference: bool
    # Reference sums per pair id: computed once, reused in later epochs.
    ref_cache: dict[str, tuple[float, float]] = field(default_factory=dict)


def _response_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        ids = ids + [tokenizer.eos_token_id]
    return ids


def load_pairs(files: list[str], cfg, tokenizer, *, source: str) -> list[Pair]:
    d, p = cfg.data, cfg.dpo
    pairs: list[Pair] = []
    for f in files:
        for i, row in enumerate(read_rows(f)):
            prompt, chosen, rejected = (_lookup(row, d.prompt_key), _lookup(row, p.chosen_key),
                                        _lookup(row, p.rejected_key))
            for key, value in ((d.prompt_key, prompt), (p.chosen_key, chosen), (p.rejected_key, rejected)):
                if value is None:
                    raise ValueError(f"{source} file {f!r} row {i}: missing key {key!r}")
            if isinstance(prompt, list):
                prompt = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            for key, value in ((p.chosen_key, chosen), (p.rejected_key, rejected)):
                if not isinstance(value, str):
                    raise ValueError(f"{source} file {f!r} row {i}: {key!r} must be a string")
            rc, rr = _lookup(row, p.ref_chosen_key), _lookup(row, p.ref_rejected_key)
            pairs.append(Pair(id=f"{f}:{i}", prompt_ids=tokenizer(prompt)["input_ids"],
                              chosen_ids=_response_ids(tokenizer, chosen), rejected_ids=_response_ids(tokenizer, rejected),
                              ref_chosen=float(rc) if rc is not None else None,
                              ref_rejected=float(rr) if rr is not None else None))
    if not pairs:
        raise ValueError(f"{source}: no preference pairs in {files}")
    return pairs


def load_state(cfg: RunConfig, tokenizer, position: int) -> tuple[PromptStream, DPOState]:
    """The training pairs as a seeded stream at `position`, and the held-out pairs."""
    train = load_pairs(cfg.data.train_files, cfg, tokenizer, source="data.train_files")
    heldout_files = cfg.dpo.heldout_files or cfg.data.heldout_files
    heldout = load_pairs(heldout_files, cfg, tokenizer, source="dpo.heldout_files") if heldout_files else []
    if cfg.data.heldout_size:
        heldout = heldout[:cfg.data.heldout_size]
    precomputed = all(p.ref_chosen is not None and p.ref_rejected is not None for p in train + heldout)
    return (PromptStream(train, seed=cfg.data.seed, shuffle=cfg.data.shuffle, position=position),
            DPOState(heldout, precomputed))


async def fill_reference(ctx: RunContext, pairs: list[Pair]) -> None:
    """Reference sums for pairs that lack them, from the reference pool, cached by pair id."""
    state: DPOState = ctx.state
    missing = [p for p in pairs if (p.ref_chosen is None or p.ref_rejected is None) and p.id not in state.ref_cache]
    if missing:
        prompts = [p.prompt_ids for p in missing] * 2
        responses = [p.chosen_ids for p in missing] + [p.rejected_ids for p in missing]
        sums = await ctx.reference.call(lambda stub: remote.sequence_logprob_sums(stub, prompts, responses))
        for i, p in enumerate(missing):
            state.ref_cache[p.id] = (sums[i], sums[len(missing) + i])
    for p in pairs:
        if p.ref_chosen is None or p.ref_rejected is None:
            p.ref_chosen, p.ref_rejected = state.ref_cache[p.id]


async def preference_metrics(ctx: RunContext, pairs: list[Pair]) -> dict[str, float]:
    """How the current policy ranks held-out pairs.

    preference_accuracy: share of pairs whose implicit reward (policy minus reference log-prob) ranks
    chosen above rejected, as the trainer's rewards/accuracy; it is 0 while policy = reference (all ties).
    logp_accuracy: share of pairs where the policy itself gives chosen the higher log-prob (meaningful
    before training too). reward_margin: mean beta * ((pi_c - ref_c) - (pi_r - ref_r)).
    """
    if not pairs:
        return {}
    await fill_reference(ctx, pairs)
    prompts = [p.prompt_ids for p in pairs] * 2
    responses = [p.chosen_ids for p in pairs] + [p.rejected_ids for p in pairs]
    sums = await remote.sequence_logprob_sums(ctx.trainer, prompts, responses)
    n = len(pairs)
    margins = [(sums[i] - p.ref_chosen) - (sums[n + i] - p.ref_rejected) for i, p in enumerate(pairs)]
    return {"heldout_preference_accuracy": sum(1 for h in margins if h > 0) / n,
            "heldout_logp_accuracy": sum(1 for i in range(n) if sums[i] > sums[n + i]) / n,
            "heldout_reward_margin": ctx.cfg.dpo.beta * sum(margins) / n,
            "heldout_logps/chosen": sum(sums[:n]) / n, "heldout_logps/rejected": sum(sums[n:]) / n}


async def dpo_step(ctx: RunContext) -> dict[str, float]:
    """take pairs -> reference log-probs (cached) -> TrainDPO -> metrics (replicas are synced lazily, see below)."""
    timer = PhaseTimer()
    start = time.perf_counter()
    d = ctx.cfg.dpo
    pairs = ctx.data.take(d.batch_size)
    with timer("reference"):
        await fill_reference(ctx, pairs)
    # Before the update: the trainer records the data position after it with the step (services/trainer/steps.py).
    ctx.data.advance(d.batch_size)
    # The trainer keeps what was measured so far with its record of the step (coordinator/runapi/recovery.py).
    sent = {**{f"time/{k}": v for k, v in timer.seconds.items()}, "data_position": float(ctx.data.position),
            "epoch": float(ctx.data.epoch)}
    with timer("train"):
        _, metrics = await remote.train_dpo(ctx.trainer, pairs, ctx.losses.dpo,
                                            remote.RunStep(ctx.run_id, ctx.step + 1, ctx.data.position, sent))
    out = update_metrics(metrics)
    # TrainDPO bumps the trainer's weight version. Rollout replicas only serve held-out evaluation here, so
    # they are not pushed every step: phases.generate brings them to this version before they generate.
    ctx.weight_version += 1
    out["weight_version"] = float(ctx.weight_version)
    ctx.step += 1
    seconds = time.perf_counter() - start
    out.update({**{f"time/{k}": v for k, v in timer.seconds.items()}, "time/step": seconds,
                "pairs_per_s": len(pairs) / seconds, "data_position": float(ctx.data.position),
                "epoch": float(ctx.data.epoch)})
    return out


def update_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """A TrainDPO answer's metrics as the step records them; the RL-shaped keys let the same CLI lines, plots and
    summaries show DPO runs."""
    out = {f"dpo/{k}": v for k, v in metrics.items()}
    return {**out, "reward_mean": out.get("dpo/rewards/margins", math.nan),
            "accuracy": out.get("dpo/rewards/accuracy", math.nan)}


def recovered_metrics(applied: dict) -> dict[str, float]:
    """A step the coordinator never committed, from the trainer's record of it (coordinator/runapi/recovery.py)."""
    return {**applied.get("coordinator", {}), **update_metrics(applied.get("update", {}))}


async def evaluate(ctx: RunContext) -> dict[str, float]:
    """Held-out preference metrics (trainer vs reference log-probs) and greedy task accuracy (rollout, scored by
    the run's reward)."""
    pref, task = await asyncio.gather(preference_metrics(ctx, ctx.state.heldout), reporting.evaluate(ctx))
    return {"heldout_preference_accuracy": float("nan"), **pref, **task}


def reference_needed(cfg: RunConfig, state: DPOState) -> str:
    if state.has_precomputed_reference:
        return ""
    return "DPO needs a reference pool unless the dataset carries ref_chosen_logprob / ref_rejected_logprob"


def summary(history: list[dict], final_evals: dict) -> dict:
    """summary.json's DPO keys: preference accuracy before and after, the margin as the reward curve."""
    return {"algorithm": "dpo",
            "heldout_preference_accuracy_before": next(
                (m.get("heldout_preference_accuracy") for m in history if m["step"] == 0), float("nan")),
            "heldout_preference_accuracy_after": final_evals.get("heldout_preference_accuracy"),
            "reward_curve": [m.get("dpo/rewards/margins") for m in history if "reward_mean" in m]}


# Rollout and reward pools only serve held-out task accuracy here: used when configured.
DPO = Algorithm(load=load_state, step=dpo_step, evaluate=evaluate, reference_needed=reference_needed,
                needs_rollout=False, summary=summary, recovered_metrics=recovered_metrics)
