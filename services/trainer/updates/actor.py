"""The policy update of PPO / GRPO and their relatives (TrainActor): the run's policy loss (policy_losses.py:
PPO's clipped surrogate, GSPO, CISPO, ...) with optional KL and entropy terms over each micro-batch; the loop is
runner.py's."""

from __future__ import annotations

import torch

from services.common.tensors.fused import sequence_logprobs
from services.trainer.batch import has_loss_mask, is_on_policy, loss_mask_of, num_model_tokens
from services.trainer.parallel.layout import RankLayout
from services.trainer.updates.losses import AGG_MODES, aggregate, kl_penalty
from services.trainer.updates.policy_losses import bound_policy_loss
from services.trainer.parallel.pipeline import last_stage_head, stage_logprobs
from services.trainer.model.trained import Trained
from services.trainer.types import ActorLoss, TrainSample
from services.trainer.updates.runner import Update

STAT_KEYS = ("pg_loss", "kl_loss", "entropy_loss", "loss", "clipped", "approx_kl", "entropy", "tokens")


def actor_loss(logp, mask, entropy, old, adv, ref, loss: ActorLoss, denom: float):
    """Loss of one micro-batch (normalised by the whole mini-batch's `denom`) and its stats [8]. `mask` [B, T]:
    the response tokens the model sampled (padding and observation tokens 0); every term and stat counts only
    those, whatever the other tokens' advantages or log-probs hold."""
    # Off the mask the inputs are neutralised, not only multiplied by 0: an observation token's old log-prob may be
    # anything (0.0 from the rollout, a huge ratio), and inf * 0 would be a nan in the loss or its gradient.
    mask = mask.bool()
    here = logp.detach()
    old, adv = torch.where(mask, old, here), torch.where(mask, adv, torch.zeros_like(adv))
    if ref is not None:
        ref = torch.where(mask, ref, here)
    pg, clipped = bound_policy_loss(loss.policy_loss, loss.policy_loss_settings)(logp, old, adv, mask)
    agg = dict(denom=denom, scale=loss.loss_scale_factor)
    pg_loss = aggregate(pg, mask, loss.loss_agg_mode, **agg)
    ent_loss = aggregate(entropy, mask, loss.loss_agg_mode, **agg)
    total = pg_loss - loss.entropy_coef * ent_loss
    kl_loss = torch.zeros((), device=logp.device)
    if ref is not None:
        kl_loss = aggregate(kl_penalty(logp, ref, loss.kl_type), mask, loss.loss_agg_mode, **agg)
        total = total + loss.kl_coef * kl_loss
    with torch.no_grad():
        # Stays on the device: read once per TrainActor call, not once per micro-batch.
        m = mask.float()
        stats = torch.stack([x.double() for x in (pg_loss, kl_loss, ent_loss, total, (clipped * m).sum(),
                                                  ((old - logp) * m).sum(), (entropy * m).sum(), m.sum())])
    return total, stats


class ActorUpdate(Update):
    """ppo_epochs over the samples' mini-batches. Without old log-probs (one optimizer step per batch) the
    update's own detached log-probs stand in. A sample's loss mask (multi-turn episodes: 0 on observation tokens)
    multiplies into the response mask of every micro-batch, padded, packed or pipelined."""

    stat_keys = STAT_KEYS

    def __init__(self, layout: RankLayout, trained: Trained, samples: list[TrainSample], loss: ActorLoss, *,
                 fused: bool):
        super().__init__(layout, trained, samples, epochs=loss.ppo_epochs, mini_batch_size=loss.mini_batch_size,
                         lengths=[len(s.prompt_ids) + len(s.response_ids) for s in samples])
        self.settings = loss
        # Log-probs and entropy through the fused LM head (services/common/tensors/fused.py).
        self.fused = fused
        self.use_kl = loss.kl_coef > 0 or all(len(s.ref_logprobs) == len(s.response_ids) for s in samples)
        self.on_policy = is_on_policy(samples)
        # Observation tokens carry no loss: the normalisers count the model's tokens (and sequences with one).
        self.masked = any(has_loss_mask(s) for s in samples)
        self.model_tokens = [num_model_tokens(s) for s in samples]

    def denom(self, idx: list[int]) -> float:
        if AGG_MODES[self.settings.loss_agg_mode].unit == "token":
            return sum(self.model_tokens[i] for i in idx)
        return sum(1 for i in idx if self.model_tokens[i] > 0)

    def token_mask(self, rows: list[TrainSample], mask: torch.Tensor) -> torch.Tensor:
        """The response mask [B, R] of `rows` with their loss masks applied (as is when no sample has one)."""
        if not self.masked:
            return mask
        return mask & (self.layout.padded([loss_mask_of(s) for s in rows], mask.shape[1]) > 0)

    def dummy(self) -> TrainSample:
        pad = self.layout.pad_id
        return TrainSample([pad], [pad], [0.0], [0.0], [0.0])

    def loss(self, rows: list[TrainSample], denom: float):
        with self.layout.amp():
            logp, mask, entropy = self.logprobs_of([s.prompt_ids for s in rows], [s.response_ids for s in rows])
        return self.loss_of(rows, logp, mask, entropy, denom)

    def loss_of(self, rows: list[TrainSample], logp: torch.Tensor, mask: torch.Tensor, entropy: torch.Tensor,
                denom: float):
        """`loss` from the rows' (logp, mask, entropy) [B, R] (R: at least their longest response), however
        computed (alone, or beside other runs' rows: updates/merged.py)."""
        layout, width = self.layout, logp.shape[1]
        mask = self.token_mask(rows, mask)
        ref = layout.padded([s.ref_logprobs for s in rows], width) if self.use_kl else None
        old = logp.detach() if self.on_policy else layout.padded([s.old_logprobs for s in rows], width)
        return actor_loss(logp, mask, entropy, old, layout.padded([s.advantages for s in rows], width), ref,
                          self.settings, denom)

    def logprobs_of(self, prompts, responses):
        """(logp, mask, entropy) [B, R] of one micro-batch, with gradients (packed rows and the fused head
        when on)."""
        return sequence_logprobs(self.trained.forward, prompts, responses, pad_id=self.layout.pad_id,
                                 device=self.layout.device, temperature=self.settings.temperature,
                                 packed=self.layout.packed, fused=self.fused)

    def pipeline_inputs(self, rows: list[TrainSample], real: list[bool]):
        layout = self.layout
        input_ids, positions, mask, targets = layout.pp_inputs([s.prompt_ids for s in rows],
                                                               [s.response_ids for s in rows], real)
        mask = self.token_mask(rows, mask)
        width = positions.shape[1]

        def pick(attr: str) -> torch.Tensor:
            return layout.padded([getattr(s, attr) for s in rows], width)

        # Everything the loss needs per token rides in one target tensor, split into micro-batches with the ids.
        ref = pick("ref_logprobs") if self.use_kl else torch.zeros_like(mask.float())
        target = torch.stack([positions.float(), targets.float(), mask.float(), pick("old_logprobs"),
                              pick("advantages"), ref], dim=-1)                                 # [B, R, 6]
        return input_ids, target

    def pipeline_loss(self, hidden: torch.Tensor, target: torch.Tensor, denom: float):
        positions, tokens, mask = target[..., 0].long(), target[..., 1].long(), target[..., 2] > 0
        logp, entropy = stage_logprobs(hidden, last_stage_head(self.trained.stages), positions, tokens, mask,
                                       self.settings.temperature)
        old = logp.detach() if self.on_policy else target[..., 3]
        ref = target[..., 5] if self.use_kl else None
        return actor_loss(logp, mask, entropy, old, target[..., 4], ref, self.settings, denom)

    def metrics(self, totals: dict[str, float], num_mini: int, seconds: float) -> dict[str, float]:
        t, tokens = totals, totals["tokens"]
        return {
            "pg_loss": t["pg_loss"] / num_mini, "kl_loss": t["kl_loss"] / num_mini,
            "entropy_loss": t["entropy_loss"] / num_mini, "loss": t["loss"] / num_mini,
            "entropy": t["entropy"] / max(tokens, 1), "clip_frac": t["clipped"] / max(tokens, 1),
            "approx_kl": t["approx_kl"] / max(tokens, 1),
            # The model's tokens (observation tokens of episodes are not trained on).
            "num_tokens": float(sum(self.model_tokens)),
            "tokens_per_s": self.epochs * sum(self.lengths) / max(seconds, 1e-9),
            "pipeline_bubble_fraction": self.layout.bubble_fraction(len(self.trained.stages)),
        }
