"""The training API's two halves of an update (docs/training_api.md): `forward_backward` adds the gradient of a
batch of Datums under one loss to what earlier calls left, `optim_step` applies it with the caller's AdamW
hyperparameters. Tinker's semantics: every loss is a sum over positions and Datums, no normaliser.

A Datum's positions are all trained through the actor's own log-prob path: its sequence is model_input plus the
last target token, read as a one-token prompt and a response of every target (rank 0 has checked that targets are
the inputs shifted by one: `validate_datums`).
"""

from __future__ import annotations

import math
import time

import torch

from services.common.tensors.fused import sequence_logprobs
from services.trainer.model import adapter_set
from services.trainer.model.optim import apply_hyperparams
from services.trainer.model.trained import Trained, optimizer_step
from services.trainer.parallel.mesh import all_reduce_sum, gather_to_rank0
from services.trainer.parallel.layout import RankLayout
from services.trainer.policy_losses import policy_loss_settings
from services.trainer.rank import Rank
from services.trainer.types import Datum, PrimitiveLoss
from services.trainer.updates.policy_losses import bound_policy_loss
from services.trainer.updates.runner import Update, accumulate_gradients

STAT_KEYS = ("loss", "tokens", "clipped")


def validate_datums(data: list[Datum], loss: PrimitiveLoss, *, vocab_size: int, max_len: int | None) -> None:
    """Rank 0's check before any rank runs: a ValueError names the loss key or data[i].<field>."""
    policy, settings = loss.policy_loss()
    if policy:
        policy_loss_settings(policy, settings, key="loss_fn")
    if not data:
        raise ValueError("data: empty batch")
    for i, d in enumerate(data):
        n = len(d.model_input)
        if n == 0 or len(d.target_tokens) != n:
            raise ValueError(f"data[{i}].target_tokens: one per model_input position ({n}), got {len(d.target_tokens)}")
        if list(d.target_tokens[:-1]) != list(d.model_input[1:]):
            raise ValueError(f"data[{i}].target_tokens: must be model_input shifted by one (target_tokens[j] == "
                             f"model_input[j + 1]); other targets are not supported")
        if max_len is not None and n + 1 > max_len:
            raise ValueError(f"data[{i}].model_input: {n} tokens and a target exceed the model's {max_len} positions")
        bad = [t for t in (*d.model_input, d.target_tokens[-1]) if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"data[{i}].model_input: token id {bad[0]} outside the vocabulary [0, {vocab_size})")
        needed = ("logprobs", "advantages") if policy else ()
        for name in ("weights", "logprobs", "advantages"):
            values = getattr(d, name)
            if (values or name in needed) and len(values) != n:
                raise ValueError(f"data[{i}].{name}: one per position ({n}), got {len(values)}"
                                 + (f" ({loss.loss_fn} reads it)" if name in needed else ""))
            if not all(math.isfinite(v) for v in values):
                raise ValueError(f"data[{i}].{name}: not finite")


class DatumUpdate(Update):
    """One forward and backward over every Datum (one "mini-batch", the whole call), no optimizer step."""

    stat_keys = STAT_KEYS

    def __init__(self, layout: RankLayout, trained: Trained, data: list[Datum], loss: PrimitiveLoss, *, fused: bool):
        super().__init__(layout, trained, data, epochs=1, mini_batch_size=len(data),
                         lengths=[len(d.model_input) + 1 for d in data])
        self.policy, self.settings = loss.policy_loss()
        self.fused = fused
        # Each Datum's log-probs of its targets, by its index in the call (this rank's rows).
        self.index = {id(d): i for i, d in enumerate(data)}
        self.outputs: dict[int, list[float]] = {}

    def denom(self, idx: list[int]) -> float:
        return 1.0                                  # Tinker's losses are sums

    def dummy(self) -> Datum:
        pad = self.layout.pad_id
        return Datum([pad], [pad], [0.0], [0.0], [0.0])

    def loss(self, rows: list[Datum], denom: float):
        layout = self.layout
        with layout.amp():
            logp, mask, _ = sequence_logprobs(self.trained.forward, [d.model_input[:1] for d in rows],
                                              [d.target_tokens for d in rows], pad_id=layout.pad_id,
                                              device=layout.device, packed=layout.packed, fused=self.fused)
        logp, width = logp.float(), logp.shape[1]
        for b, d in enumerate(rows):
            if id(d) in self.index:
                self.outputs[self.index[id(d)]] = logp[b, :len(d.target_tokens)].detach().tolist()
        if not self.policy:
            weights = layout.padded([d.weights or [1.0] * len(d.target_tokens) for d in rows], width)
            token_loss, mask = -logp * weights, mask.bool() & (weights != 0)
            clipped = torch.zeros_like(logp)
        else:
            adv = layout.padded([d.advantages for d in rows], width)
            mask = mask.bool() & (adv != 0)
            # Off the mask the ratio is 1 and the advantage 0: a prompt position's logprob (0.0, or anything the
            # caller left there) can give no inf * 0.
            here = logp.detach()
            old = torch.where(mask, layout.padded([d.logprobs for d in rows], width), here)
            token_loss, clipped = bound_policy_loss(self.policy, self.settings)(logp, old, adv, mask)
        m = mask.float()
        total = (token_loss * m).sum() / denom
        with torch.no_grad():
            stats = torch.stack([total.detach().double(), m.sum().double(), (clipped * m).sum().double()])
        return total, stats

    def metrics(self, totals: dict[str, float], num_mini: int, seconds: float) -> dict[str, float]:
        return {"loss:sum": totals["loss"], "num_tokens": totals["tokens"],
                "clip_frac": totals["clipped"] / max(totals["tokens"], 1.0), "num_datums": float(len(self.items)),
                "seconds": seconds}


def forward_backward(rank: Rank, data: list[Datum], loss: PrimitiveLoss,
                     adapter: str = "") -> tuple[dict[str, float], list[list[float]]]:
    """Adds the batch's gradient to the actor's, or to named adapter `adapter`'s alone (every rank); -> (metrics,
    each Datum's target log-probs) on rank 0, the same metrics and an empty list elsewhere."""
    t0 = time.perf_counter()
    with adapter_set.using(rank, adapter) as trained:
        update = DatumUpdate(rank.layout, trained, data, loss, fused=rank.fused_logprobs)
        local = accumulate_gradients(update, list(range(len(data))))
    if adapter:
        adapter_set.get(rank, adapter).pending += 1
    layout = rank.layout
    totals = all_reduce_sum(all_reduce_sum(local.tolist(), group=layout.pp_group), group=layout.dp_group)
    metrics = update.metrics(dict(zip(STAT_KEYS, totals)), 1, time.perf_counter() - t0)
    parts = gather_to_rank0(update.outputs, group=rank.group) if rank.dims.world_size > 1 else [update.outputs]
    if parts is None:
        return metrics, []
    merged = {k: v for part in parts for k, v in part.items()}
    return metrics, [merged.get(i, []) for i in range(len(data))]


def optim_step(rank: Rank, actor_cfg, adapter: str = "") -> dict[str, float]:
    """One AdamW step over the accumulated gradients with `actor_cfg`'s hyperparameters (checked on rank 0), of
    the actor or of named adapter `adapter` alone (its gradients, its optimizer); a non-finite gradient norm skips
    it (the weights stay, the gradients are dropped)."""
    t0 = time.perf_counter()
    with adapter_set.using(rank, adapter) as trained:
        if trained.cfg != actor_cfg:
            trained.cfg = actor_cfg
            apply_hyperparams(trained.optimizer, trained.scheduler, actor_cfg, reset_schedule=False)
        norm, lr, ok = optimizer_step(trained, rank.layout)
    if adapter:
        named = adapter_set.get(rank, adapter)
        named.pending = 0
        named.weight_version += int(ok)
    elif ok:
        rank.weight_version += 1
        rank.pristine = False
    return {"grad_norm": float(norm), "lr": lr, "skipped": 0.0 if ok else 1.0, "seconds": time.perf_counter() - t0}
