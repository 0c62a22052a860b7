"""The one loop every update kind runs: epochs -> shuffled mini-batches -> this rank's micro-batches (or the
pipeline schedule), one optimizer step per mini-batch, stats summed on the device and over ranks once at the end.

An update kind (actor.py, critic.py, dpo.py) says only what one micro-batch's loss is and what its metrics
are. Loss normalisers (`denom`) count the whole mini-batch, so micro-batches, pipeline micro-batches and DP
ranks add up to exactly the mini-batch gradient.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any, Sequence

import torch

from services.trainer.batch import mini_batches
from services.trainer.parallel.layout import RankLayout
from services.trainer.nvtx import phase
from services.trainer.parallel.mesh import all_reduce_sum
from services.trainer.model.trained import Trained, finish_deferred, grad_sync, optimizer_step


class Update(ABC):
    """One update of `trained` over `items`; a subclass gives the loss of a micro-batch and the metrics."""

    # The stats each loss returns [len(stat_keys)], summed over micro-batches, mini-batches and ranks.
    stat_keys: tuple[str, ...]

    def __init__(self, layout: RankLayout, trained: Trained, items: Sequence[Any], *, epochs: int,
                 mini_batch_size: int, lengths: list[int]):
        self.layout, self.trained, self.items = layout, trained, items
        self.epochs, self.mini_batch_size = epochs, mini_batch_size
        # What each item costs against the micro-batch token budget.
        self.lengths = lengths

    @abstractmethod
    def denom(self, idx: list[int]) -> float:
        """The loss normaliser of the mini-batch `idx` (over every rank's share)."""

    @abstractmethod
    def dummy(self) -> Any:
        """A one-token item standing in for a missing row (it weighs nothing)."""

    @abstractmethod
    def loss(self, rows: list[Any], denom: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward of one micro-batch of items: its loss (over `denom`) and its stats, on the device."""

    def pipeline_inputs(self, rows: list[Any], real: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
        """Input ids of this rank's pipelined rows and the target tensor the last stage's loss reads."""
        raise NotImplementedError(f"{type(self).__name__}: no pipeline-parallel path")

    def pipeline_loss(self, hidden: torch.Tensor, target: torch.Tensor,
                      denom: float) -> tuple[torch.Tensor, torch.Tensor]:
        """`loss` on the last pipeline stage: from one pipeline micro-batch's final hidden states and its target
        (the LM head runs here, in chunks: services.trainer.parallel.pipeline.stage_logprobs)."""
        raise NotImplementedError(f"{type(self).__name__}: no pipeline-parallel path")

    @abstractmethod
    def metrics(self, totals: dict[str, float], num_mini: int, seconds: float) -> dict[str, float]:
        """This kind's metrics from the stats summed over the call (`num_mini` mini-batches)."""


def batch_order(n: int, *, seed: int | None, step: int, epoch: int) -> list[int]:
    """The order in which an epoch visits the batch; None = as given."""
    if seed is None:
        return list(range(n))
    # Seeded by (seed, step, epoch): identical on every rank, and after a checkpoint restore.
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + epoch)
    return torch.randperm(n, generator=g).tolist()


def run_update(update: Update, *, seed: int | None, defer_last_step: bool) -> dict[str, float]:
    """Runs the update on this rank (every rank runs it); returns its metrics (the same on every rank).

    defer_last_step: the last optimizer step checks its gradient norm after the fact, with the call's stats
    (fused AdamW only, see trained.optimizer_step)."""
    t0 = time.perf_counter()
    trained, n = update.trained, len(update.items)
    # This rank's part, on the device; summed over ranks once at the end (every sum is linear).
    local = torch.zeros(len(update.stat_keys), dtype=torch.float64, device=update.layout.device)
    steps = StepLog()
    batches = mini_batches(n, update.mini_batch_size)
    for epoch in range(update.epochs):
        order = batch_order(n, seed=seed, step=trained.step, epoch=epoch)
        for k, mb in enumerate(batches):
            with phase("forward_backward"):
                local += _mini_batch(update, [order[j] for j in mb])
            last = epoch == update.epochs - 1 and k == len(batches) - 1
            steps.add(*optimizer_step(trained, update.layout, defer=last and defer_last_step))
    totals = dict(zip(update.stat_keys, steps.finish(local, trained, update.layout)))
    seconds = time.perf_counter() - t0
    return {**update.metrics(totals, steps.num_mini, seconds), **steps.metrics(trained, seconds)}


class StepLog:
    """What the optimizer steps of one call did; the last one's norm may still be on the device (deferred)."""

    def __init__(self):
        self.norms: list[float] = []
        self.lrs: list[float] = []
        self.num_steps = self.num_mini = 0
        self.pending: torch.Tensor | None = None

    def add(self, norm, lr: float, ok: bool | None) -> None:
        self.lrs.append(lr)
        self.num_mini += 1
        if ok is None:
            self.pending = norm
            return
        self.norms.append(norm)
        self.num_steps += ok

    def finish(self, local: torch.Tensor, trained: Trained, layout: RankLayout) -> list[float]:
        """The stats summed over pipeline stages and DP ranks; a deferred step's norm is read with them."""
        if self.pending is not None:
            # The stats and the last step's norm in one read: the only wait for the GPU in this call.
            *stats, norm = torch.cat([local, self.pending.to(local.dtype).reshape(1)]).tolist()
            self.norms.append(norm)
            self.num_steps += finish_deferred(trained, norm)
        else:
            stats = local.tolist()
        return all_reduce_sum(all_reduce_sum(stats, group=layout.pp_group), group=layout.dp_group)

    def metrics(self, trained: Trained, seconds: float) -> dict[str, float]:
        return {"grad_norm": sum(self.norms) / len(self.norms), "lr": self.lrs[-1],
                "num_optimizer_steps": float(self.num_steps),
                "num_skipped_steps": float(self.num_mini - self.num_steps),
                "loss_scale": trained.loss_scale, "seconds": seconds}


def accumulate_gradients(update: Update, idx: list[int]) -> torch.Tensor:
    """Forward/backward of the items `idx` as one mini-batch, no optimizer step: the gradients add to what the
    parameters hold (the training API's ForwardBackward, updates/primitive.py); this rank's stats on the device."""
    return _mini_batch(update, idx)


def _mini_batch(update: Update, idx: list[int]) -> torch.Tensor:
    """Forward/backward of one mini-batch over this rank's micro-batches; this rank's stats on the device
    (under PP the last stage holds them, other stages zeros)."""
    layout = update.layout
    denom = update.denom(idx)
    # FSDP and DDP average gradients over DP ranks; scaling by dp turns that into the sum over the
    # mini-batch, whose normaliser (denom) already counts every rank's share. The fp16 loss scale rides along.
    scale = float(layout.dims.dp) * update.trained.loss_scale
    if layout.dims.pp > 1:
        stats = _pipeline(update, idx, denom, scale)
    else:
        stats = _micro_batches(update, idx, denom, scale)
    layout.sync_tied_grads()
    return stats


def _micro_batches(update: Update, idx: list[int], denom: float, scale: float) -> torch.Tensor:
    """This DP rank's share of the mini-batch, packed by token budget; gradients sync on the last micro-batch."""
    stats = torch.zeros(len(update.stat_keys), dtype=torch.float64, device=update.layout.device)
    groups = update.layout.local_groups(idx, update.lengths, update.trained.cfg.micro_batch_token_budget)
    for g, group in enumerate(groups):
        rows = [update.items[i] for i in group] if group else [update.dummy()]
        weight = 1.0 if group else 0.0
        with grad_sync(update.trained, last=g == len(groups) - 1):
            total, st = update.loss(rows, denom)
            (total * (weight * scale)).backward()
        stats += weight * st
    return stats


def _pipeline(update: Update, idx: list[int], denom: float, scale: float) -> torch.Tensor:
    """One mini-batch through the pipeline schedule; the last stage computes the loss per micro-batch."""
    layout = update.layout
    shard = layout.pp_rows(idx)
    input_ids, target = update.pipeline_inputs([update.items[i] if i is not None else update.dummy() for i in shard],
                                               [i is not None for i in shard])
    calls: list[torch.Tensor] = []

    def loss_fn(hidden, tgt):
        total, stats = update.pipeline_loss(hidden, tgt, denom)
        calls.append(stats)
        return total * scale

    layout.run_pipeline(update.trained.stages, input_ids, target, loss_fn=loss_fn)
    # A new stage first calls loss_fn once more to infer gradient shapes; the real calls come last.
    real = calls[-layout.num_microbatches:] if layout.is_last_stage else []
    return sum(real, torch.zeros(len(update.stat_keys), dtype=torch.float64, device=layout.device))

