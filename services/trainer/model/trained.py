"""A model being trained (the actor, or the critic's value model) with its optimizer, schedule and fp16 loss
scaler, and its optimizer step: clip, step, schedule, or skip the step when the gradient norm is not finite."""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from services.trainer.config import ActorConfig, OptimSection
from services.trainer.parallel.layout import RankLayout
from services.trainer.nvtx import phase
from services.trainer.model.optim import DynamicLossScaler, build_adamw, clip_grad_norm, lr_lambda
from services.trainer.parallel.parallelize import parallelize


class ValueModel(nn.Module):
    """The causal LM's backbone with a scalar head: one value per position."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.model = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.normal_(self.value_head.weight, std=1.0 / (hidden_size + 1))
        nn.init.zeros_(self.value_head.bias)

    @property
    def config(self):
        return self.model.config

    def forward(self, input_ids, attention_mask=None, **kwargs):
        # kwargs: position ids and packed sequences (services/common/tensors/packing.py).
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                            **kwargs).last_hidden_state
        values = self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1)       # [B, L]
        # A copy, not a view: FSDP's pre-backward hook on a returned view is lost by in-place ops.
        return values.float() if values.dtype != torch.float32 else values.clone()


@dataclass
class Trained:
    """A model with its optimizer and schedule; actor and critic never share one."""

    name: str
    module: nn.Module          # parameters, state dicts, names
    forward: nn.Module         # what forward/backward runs through (the DDP wrapper under dp_mode ddp)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    cfg: OptimSection
    step: int = 0
    # What a pipeline schedule runs: this rank's stage modules in stage order ([forward] without PP).
    stages: list[nn.Module] = field(default_factory=list)
    # Dynamic loss scaling when the compute dtype is float16 (None otherwise).
    scaler: DynamicLossScaler | None = None

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0


def build_trained(name: str, module: nn.Module, mesh, cfg: OptimSection, actor: ActorConfig, param_dtype: str,
                  compute_dtype: str, *, compile: bool = False) -> Trained:
    stages = parallelize(module, mesh, dp_mode=actor.dp_mode, activation_checkpointing=actor.activation_checkpointing,
                         param_dtype=param_dtype, compute_dtype=compute_dtype, compile=compile,
                         stages_per_rank=actor.stages_per_rank, checkpoint_every=actor.activation_checkpointing_every)
    # Several stages per rank run only through the schedule; `module` holds their parameters.
    forward = stages[0] if len(stages) == 1 else module
    optimizer = build_adamw(module.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                            weight_decay=cfg.weight_decay, name=name)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    scaler = (DynamicLossScaler(actor.loss_scale_init, growth_interval=actor.loss_scale_growth_interval)
              if compute_dtype == "float16" else None)
    return Trained(name, module, forward, optimizer, scheduler, cfg, stages=stages, scaler=scaler)


def grad_sync(trained: Trained, *, last: bool):
    """DDP all-reduces once per optimizer step, on the last micro-batch (FSDP reduce-scatters each one
    to keep gradients sharded); a no-op without DDP."""
    no_sync = getattr(trained.forward, "no_sync", None)
    return nullcontext() if last or no_sync is None else no_sync()


def optimizer_step(trained: Trained, layout: RankLayout, *,
                   defer: bool = False) -> tuple[float | torch.Tensor, float, bool | None]:
    """Clips, steps and schedules; a non-finite gradient norm skips the step (weights stay).

    defer=True (the call's last step) with a fused AdamW and no loss scaler: nothing waits for the GPU.
    The norm stays a device tensor, the fused kernel gets `found_inf` (non-finite norm) and leaves the
    weights and its state alone when set; ok is None and `finish_deferred` steps the scheduler (or
    counts the skip) once the caller has read the norm with its other results, in one host sync."""
    with phase("optimizer"):
        if defer and trained.scaler is None and trained.optimizer.defaults.get("fused"):
            return _deferred_step(trained, layout)
        return _step(trained, layout)


def finish_deferred(trained: Trained, norm: float) -> bool:
    ok = math.isfinite(norm)
    if ok:
        trained.scheduler.step()
        trained.step += 1
    return ok


def _clip(trained: Trained, layout: RankLayout, *, sync: bool = True) -> float | torch.Tensor:
    """The global grad norm, clipped (and fp16-unscaled) in place; a device tensor with sync=False."""
    # The optimizer's own parameters: one Trained's (a named adapter's beside the run's, on one module) whatever
    # else is trainable meanwhile, and no walk of the module's ~2,000 parameters on every step.
    params = [p for group in trained.optimizer.param_groups for p in group["params"]]
    return clip_grad_norm(params, trained.cfg.grad_clip, pp_group=layout.pp_group, skip=layout.tied_copy,
                          grad_scale=trained.loss_scale, sync=sync)


def _deferred_step(trained: Trained, layout: RankLayout) -> tuple[torch.Tensor, float, None]:
    norm = _clip(trained, layout, sync=False)
    lr = trained.optimizer.param_groups[0]["lr"]
    trained.optimizer.found_inf = (~torch.isfinite(norm)).float()
    try:
        trained.optimizer.step()
    finally:
        del trained.optimizer.found_inf
    trained.optimizer.zero_grad(set_to_none=True)
    return norm, lr, None


def _step(trained: Trained, layout: RankLayout) -> tuple[float, float, bool]:
    norm = _clip(trained, layout)
    lr = trained.optimizer.param_groups[0]["lr"]
    if trained.scaler is not None:
        trained.scaler.update(found_inf=not math.isfinite(norm))
    if not math.isfinite(norm):
        trained.optimizer.zero_grad(set_to_none=True)
        return norm, lr, False
    trained.optimizer.step()
    trained.scheduler.step()
    trained.optimizer.zero_grad(set_to_none=True)
    trained.step += 1
    return norm, lr, True
