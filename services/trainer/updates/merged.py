"""Several runs' policy updates in one pass: TrainActor calls of different LoRA adapters that queued together on one
trainer (services/trainer/coalesce.py TrainMerger) run each mini-batch's forward and backward over all their rows at
once, each row under its own adapter (model/lora_mixed.py), then each adapter's optimizer steps alone.

Each call's update is the one it gets alone, up to summation order: its rows visit the same mini-batches in the same
seeded order, its loss is normalised over its own mini-batch (ActorUpdate.denom), its gradient comes from its own
rows only (the adapters share no parameter and the base is frozen, so the sum of the calls' losses has each call's
gradient on its adapter), and its clip, learning rate and step count are its own. What merges: the micro-batches,
filled to the token budget with every call's rows, so the frozen base's GEMMs run once over all of them.

Calls merge only where the loop has one shape for all (`merge_key`: one temperature, as many epochs and mini-batches)
on a trainer of one process, eager, without fp16 loss scaling (`unmergeable`); the rest run alone, as before.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from services.trainer.batch import mini_batches
from services.trainer.model import adapter_set, lora_mixed
from services.trainer.model.lora import lora_layers
from services.trainer.model.trained import optimizer_step
from services.trainer.nvtx import phase
from services.trainer.types import ActorLoss, TrainSample
from services.trainer.updates.actor import ActorUpdate
from services.trainer.updates.runner import StepLog, batch_order


def merge_key(rank, samples: list[TrainSample], loss: ActorLoss) -> tuple | None:
    """Calls of one key run their loops in step: one temperature (one forward), epochs and mini-batch count. None:
    this trainer runs every update alone."""
    if not mixes(rank):
        return None
    return (float(loss.temperature), int(loss.ppo_epochs), len(mini_batches(len(samples), loss.mini_batch_size)))


def mixes(rank) -> bool:
    """Whether this trainer may run rows of several adapters in one forward (each layer's adapters are checked in
    the command: unmergeable)."""
    return _trainer_reason(rank) is None


def unmergeable(rank, names: list[str]) -> str | None:
    """Why these adapters' updates cannot run in one pass on this trainer, or None (command: reads the layers)."""
    return _trainer_reason(rank) or lora_mixed.unmixable(lora_layers(rank.actor.module),
                                                         [adapter_set.adapter_name(n) for n in names])


def _trainer_reason(rank) -> str | None:
    if rank.cfg.lora is None:
        return "not a LoRA trainer"
    if rank.dims.world_size > 1:
        return "a trainer of several processes"
    if rank.compiled:
        return "compiled"
    if rank.actor.scaler is not None:
        return "fp16 loss scaling"
    if any(a.pending for a in adapter_set.named(rank).values()):
        return "a training-API client's gradients wait for its OptimStep"
    return None


class BeforeAnyStep(Exception):
    """A merged pass failed before any optimizer step: no adapter changed, so each call may run alone."""


def train_together(rank, calls: list[tuple[list[TrainSample], ActorLoss, str]], *, seed: int | None) -> list[dict]:
    """The updates of `calls` ((samples, loss, adapter), distinct adapters, one merge_key) in one pass; each call's
    metrics, as run_update gives them alone (its seconds: the merged pass's)."""
    names = [adapter for _, _, adapter in calls]
    t0 = time.perf_counter()
    with adapter_set.together(rank, names) as trained:
        updates = [ActorUpdate(rank.layout, t, samples, loss, fused=rank.fused_logprobs)
                   for t, (samples, loss, _) in zip(trained, calls)]
        local = [torch.zeros(len(u.stat_keys), dtype=torch.float64, device=rank.layout.device) for u in updates]
        logs = [StepLog() for _ in updates]
        batches = [mini_batches(len(u.items), u.mini_batch_size) for u in updates]
        for epoch in range(updates[0].epochs):
            orders = [batch_order(len(u.items), seed=seed, step=u.trained.step, epoch=epoch) for u in updates]
            for k in range(len(batches[0])):
                idx = [[order[j] for j in b[k]] for order, b in zip(orders, batches)]
                with phase("forward_backward"):
                    try:
                        stats = _mini_batch(rank, updates, names, idx)
                    except Exception as e:
                        if epoch or k:      # earlier mini-batches stepped: as an update alone failing there
                            raise
                        for u in updates:   # nothing applied yet: the calls can run alone
                            u.trained.optimizer.zero_grad(set_to_none=True)
                        raise BeforeAnyStep(e) from e
                    for acc, st in zip(local, stats):
                        acc += st
                # Each adapter's clip and step read its optimizer's parameters alone: every adapter stays
                # trainable (no peft set_adapter between steps); the last steps wait for the GPU with the stats.
                last = epoch == updates[0].epochs - 1 and k == len(batches[0]) - 1
                for u, log in zip(updates, logs):
                    log.add(*optimizer_step(u.trained, u.layout, defer=last and rank.defer_last_step))
        seconds = time.perf_counter() - t0
        out = []
        for u, log, acc in zip(updates, logs, local):
            totals = dict(zip(u.stat_keys, log.finish(acc, u.trained, u.layout)))
            out.append({**u.metrics(totals, log.num_mini, seconds), **log.metrics(u.trained, seconds)})
    return out


def _mini_batch(rank, updates: list[ActorUpdate], names: list[str], idx: list[list[int]]) -> list[torch.Tensor]:
    """Forward/backward of each call's mini-batch `idx[i]`, all calls' rows filled into micro-batches by the token
    budget; each call's stats on the device."""
    layout = rank.layout
    denoms = [u.denom(ix) for u, ix in zip(updates, idx)]
    items = [(i, j) for i, ix in enumerate(idx) for j in ix]
    lengths = [updates[i].lengths[j] for i, j in items]
    budget = min(u.trained.cfg.micro_batch_token_budget for u in updates)
    stats = [torch.zeros(len(u.stat_keys), dtype=torch.float64, device=layout.device) for u in updates]
    for group in layout.local_groups(range(len(items)), lengths, budget):
        rows = [items[t] for t in group]
        samples = [updates[i].items[j] for i, j in rows]
        prompts, responses = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
        of_row = np.array([i for i, _ in rows], dtype=np.int64)
        with lora_mixed.by_row([adapter_set.adapter_name(n) for n in names], of_row, prompts, responses,
                               packed=layout.packed, device=layout.device):
            with layout.amp():
                logp, mask, entropy = updates[0].logprobs_of(prompts, responses)
            total = None
            for i in sorted(set(of_row.tolist())):
                mine = np.flatnonzero(of_row == i)
                sel = torch.from_numpy(mine).to(layout.device)
                part, st = updates[i].loss_of([samples[r] for r in mine], logp[sel], mask[sel], entropy[sel],
                                              denoms[i])
                total = part if total is None else total + part
                stats[i] += st
            total.backward()
    layout.sync_tied_grads()
    return stats
