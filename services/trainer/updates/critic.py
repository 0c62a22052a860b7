"""The value update of PPO (TrainCritic): a clipped squared error to the returns over each micro-batch; the loop
is runner.py's. Also the value model's forward, which ComputeValues shares."""

from __future__ import annotations

import torch
from torch import nn

from services.common.tensors.packing import token_layout
from services.trainer.batch import has_loss_mask, loss_mask_of, num_model_tokens
from services.trainer.parallel.layout import RankLayout
from services.trainer.updates.losses import aggregate, clipped_value_loss
from services.trainer.model.trained import Trained
from services.trainer.types import CriticLoss, CriticSample
from services.trainer.updates.runner import Update


def response_values(layout: RankLayout, model: nn.Module, prompts, responses) -> tuple[torch.Tensor, torch.Tensor]:
    """Values [B, R] of the response tokens under a ValueModel (padded entries 0), and the response mask; one
    packed row when the layout packs."""
    lay = token_layout(prompts, responses, pad_id=layout.pad_id, device=layout.device, packed=layout.packed)
    with layout.amp():
        # Right padding under the causal mask: real tokens never see padding (no attention mask needed).
        values = model(input_ids=lay.input_ids, attention_mask=None, **lay.model_kwargs)       # [B, L] or [1, T]
    picked = values.float().reshape(-1).index_select(0, lay.src)                             # [N]
    B, R = lay.mask.shape
    out = torch.zeros(B * R, dtype=picked.dtype, device=picked.device).index_copy(0, lay.dst, picked)
    return out.view(B, R), lay.mask


class CriticUpdate(Update):
    """ppo_epochs over the samples' mini-batches, the loss a token mean over each mini-batch's model tokens (a
    sample's loss mask leaves its observation tokens out of the loss and the metrics)."""

    # The value loss (summed over mini-batches); clipped tokens, values and tokens (summed over tokens).
    stat_keys = ("vf_loss", "clipped", "values", "tokens")

    def __init__(self, layout: RankLayout, trained: Trained, samples: list[CriticSample], loss: CriticLoss):
        super().__init__(layout, trained, samples, epochs=loss.ppo_epochs, mini_batch_size=loss.mini_batch_size,
                         lengths=[len(s.prompt_ids) + len(s.response_ids) for s in samples])
        self.settings = loss
        self.masked = any(has_loss_mask(s) for s in samples)
        self.model_tokens = [num_model_tokens(s) for s in samples]

    def denom(self, idx: list[int]) -> float:
        return sum(self.model_tokens[i] for i in idx)

    def dummy(self) -> CriticSample:
        pad = self.layout.pad_id
        return CriticSample([pad], [pad], [0.0], [0.0])

    def loss(self, rows: list[CriticSample], denom: float):
        layout, width = self.layout, max(len(s.response_ids) for s in rows)
        values, mask = response_values(layout, self.trained.forward, [s.prompt_ids for s in rows],
                                       [s.response_ids for s in rows])
        if self.masked:
            mask = mask & (layout.padded([loss_mask_of(s) for s in rows], width) > 0)
        # Off the mask (padding, observation tokens) the targets are the values themselves: no loss, no nan.
        here = values.detach()
        returns = torch.where(mask, layout.padded([s.returns for s in rows], width), here)
        clip = self.settings.clip_value
        old = torch.where(mask, layout.padded([s.old_values for s in rows], width), here) if clip > 0 else here
        vf, clipped = clipped_value_loss(values, old, returns, clip_value=clip)
        vf_loss = aggregate(vf, mask, "token-mean", denom=denom)
        with torch.no_grad():
            m = mask.float()
            stats = torch.stack([x.double() for x in (vf_loss, (clipped * m).sum(), (values * m).sum(), m.sum())])
        return vf_loss, stats

    def metrics(self, totals: dict[str, float], num_mini: int, seconds: float) -> dict[str, float]:
        tokens = max(totals["tokens"], 1.0)
        return {"vf_loss": totals["vf_loss"] / num_mini, "vf_clip_frac": totals["clipped"] / tokens,
                "values_mean": totals["values"] / tokens,
                "num_tokens": float(sum(self.model_tokens))}
