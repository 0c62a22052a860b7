"""The preference update (TrainDPO: DPO, IPO, conservative DPO) over mini-batches of pairs; the loop is
runner.py's.

The DPO loss is not linear in the log-probs, but it is a sum over pairs: each micro-batch holds whole pairs
(a pair's chosen and rejected rows share it) and divides by the mini-batch's pair count, so micro-batches,
pipeline micro-batches and DP ranks add up to exactly the mini-batch gradient.
"""

from __future__ import annotations

import torch

from services.common.tensors.fused import sequence_logprobs
from services.trainer.parallel.layout import RankLayout
from services.trainer.updates.losses import dpo_loss
from services.trainer.parallel.pipeline import last_stage_head, stage_logprobs
from services.trainer.model.trained import Trained
from services.trainer.types import DPOLoss, PreferencePair
from services.trainer.updates.runner import Update

DPO_STAT_KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracy", "logps/chosen",
                 "logps/rejected", "pairs", "tokens")


def dpo_pairs_loss(chosen, rejected, ref_chosen, ref_rejected, real, loss: DPOLoss, denom: float,
                   num_tokens: torch.Tensor):
    """Loss of one micro-batch of pairs (summed log-probs [k]; `real` is 0 for padding pairs), normalised by
    the whole mini-batch's pair count `denom`, and its summed stats [9] (DPO_STAT_KEYS), on the device."""
    per_pair, m = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=loss.beta, loss_type=loss.loss_type,
                           label_smoothing=loss.label_smoothing)                               # [k]
    total = (per_pair * real).sum() / denom
    with torch.no_grad():
        sums = [(m[k] * real).sum() for k in DPO_STAT_KEYS[1:7]]
        stats = torch.stack([x.double() for x in (total, *sums, real.sum(), num_tokens)])
    return total, stats


class DPOUpdate(Update):
    """One pass over the pairs' mini-batches (one optimizer step each)."""

    stat_keys = DPO_STAT_KEYS

    def __init__(self, layout: RankLayout, trained: Trained, pairs: list[PreferencePair], loss: DPOLoss, *,
                 fused: bool = False):
        # A pair's chosen and rejected rows share a micro-batch (the loss needs both), so a pair costs two
        # rows of its longer sequence against the token budget.
        super().__init__(layout, trained, pairs, epochs=1, mini_batch_size=loss.mini_batch_size,
                         lengths=[2 * (len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids)))
                                  for p in pairs])
        self.settings = loss
        # Log-probs through the fused LM head (services/common/tensors/fused.py).
        self.fused = fused

    def denom(self, idx: list[int]) -> float:
        return float(len(idx))

    def dummy(self) -> PreferencePair:
        pad = self.layout.pad_id
        return PreferencePair([pad], [pad], [pad], 0.0, 0.0)

    def loss(self, rows: list[PreferencePair], denom: float):
        layout, k = self.layout, len(rows)
        with layout.amp():
            # Chosen and rejected go through one forward: rows [0, k) and [k, 2k).
            logp, mask, _ = sequence_logprobs(self.trained.forward, [p.prompt_ids for p in rows] * 2,
                                              [p.chosen_ids for p in rows] + [p.rejected_ids for p in rows],
                                              pad_id=layout.pad_id, device=layout.device, packed=layout.packed,
                                              fused=self.fused)
        sums = logp.sum(-1)                                                                     # [2k]
        ref = torch.tensor([p.ref_chosen_logprob for p in rows] + [p.ref_rejected_logprob for p in rows],
                           dtype=torch.float32, device=layout.device)
        real = torch.ones(k, device=layout.device)
        return dpo_pairs_loss(sums[:k], sums[k:], ref[:k], ref[k:], real, self.settings, denom, mask.sum())

    def pipeline_inputs(self, rows: list[PreferencePair], real: list[bool]):
        """Rows interleave (chosen, rejected) and each DP rank's pair count is a multiple of num_microbatches,
        so every pipeline micro-batch (an equal split along the rows) holds whole pairs."""
        prompts = [p.prompt_ids for p in rows for _ in range(2)]
        responses = [ids for p in rows for ids in (p.chosen_ids, p.rejected_ids)]
        real_rows = [r for r in real for _ in range(2)]
        input_ids, positions, mask, targets = self.layout.pp_inputs(prompts, responses, real_rows)
        device = self.layout.device
        ref = torch.tensor([v for p in rows for v in (p.ref_chosen_logprob, p.ref_rejected_logprob)], device=device)
        width = positions.shape[1]

        def per_row(x: torch.Tensor) -> torch.Tensor:
            return x.float().unsqueeze(1).expand(-1, width)

        target = torch.stack([positions.float(), targets.float(), mask.float(), per_row(ref),
                              per_row(torch.tensor(real_rows, device=device))], dim=-1)                 # [2P, R, 5]
        return input_ids, target

    def pipeline_loss(self, hidden: torch.Tensor, target: torch.Tensor, denom: float):
        positions, tokens, mask = target[..., 0].long(), target[..., 1].long(), target[..., 2] > 0
        logp, _ = stage_logprobs(hidden, last_stage_head(self.trained.stages), positions, tokens, mask, 1.0)
        sums = logp.sum(-1).view(-1, 2)                                                   # [k, (chosen, rejected)]
        refs, reals = target[:, 0, 3].view(-1, 2), target[:, 0, 4].view(-1, 2)[:, 0]
        return dpo_pairs_loss(sums[:, 0], sums[:, 1], refs[:, 0], refs[:, 1], reals, self.settings, denom, mask.sum())

    def metrics(self, totals: dict[str, float], num_mini: int, seconds: float) -> dict[str, float]:
        n = max(totals["pairs"], 1.0)
        tokens = sum(2 * len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_ids) for p in self.items)
        return {"loss": totals["loss"] / num_mini, **{k: totals[k] / n for k in DPO_STAT_KEYS[1:7]},
                "num_pairs": float(len(self.items)), "num_tokens": totals["tokens"],
                "tokens_per_s": tokens / max(seconds, 1e-9),
                "pipeline_bubble_fraction": self.layout.bubble_fraction(len(self.trained.stages))}
