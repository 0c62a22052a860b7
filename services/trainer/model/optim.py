"""AdamW construction (fused / foreach where the parameters allow), its learning-rate schedule, the global
gradient-norm clip, and dynamic loss scaling for fp16 compute.

Both work on any mix the mesh produces: plain tensors (one process, DDP), DTensors of FSDP2 shards and
TP shards, possibly on different meshes (FSDP x TP leaves norm weights on the DP mesh alone).
"""

from __future__ import annotations

import logging
import math
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from services.trainer.config import OptimSection

log = logging.getLogger("meshrl.trainer")


def _mesh_key(p: torch.Tensor):
    return p.device_mesh if hasattr(p, "device_mesh") else None


def _dtensor_has_fused_adamw() -> bool:
    """Whether this torch's DTensor has a sharding rule for the fused AdamW kernel (torch >= 2.2)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    prop = DTensor._op_dispatcher.sharding_propagator
    op = torch.ops.aten._fused_adamw_.default
    return any(isinstance(table, dict) and op in table for table in vars(prop).values())


def adamw_impl(params: Sequence[nn.Parameter]) -> str:
    """"fused" (one kernel for all parameters: CUDA), "foreach" (a few kernels per dtype), or "for-loop"
    (per parameter: any mix). Lists of tensors may not mix plain tensors and DTensors, nor DTensors on
    different meshes, so a mixed model gets the loop."""
    meshes = {_mesh_key(p) for p in params}
    if len(meshes) > 1:
        return "for-loop"
    dtensor = meshes != {None}
    if (all(p.device.type == "cuda" and torch.is_floating_point(p) for p in params)
            and (not dtensor or _dtensor_has_fused_adamw())):
        return "fused"
    return "foreach"


def build_adamw(params: Iterable[nn.Parameter], *, lr: float, betas, eps: float, weight_decay: float,
                name: str = "actor") -> torch.optim.AdamW:
    params = [p for p in params if p.requires_grad]
    impl = adamw_impl(params)
    kwargs = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[impl]
    try:
        opt = torch.optim.AdamW(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, **kwargs)
    except RuntimeError as e:                # a parameter type this torch's fused kernel refuses
        log.info("%s: fused AdamW refused (%s); using foreach", name, e)
        impl = "foreach"
        opt = torch.optim.AdamW(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, foreach=True)
    log.info("%s: AdamW (%s) over %d parameters", name, impl, len(params))
    return opt


def lr_lambda(cfg: OptimSection):
    """Multiplier of the base lr after `step` optimizer steps: linear warm-up, then constant or cosine."""
    def fn(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return fn


@torch.no_grad()
def total_grad_norm(grads: Sequence[torch.Tensor], *, pp_group=None) -> torch.Tensor:
    """Global L2 norm (fp32, 0-d, on the gradients' device) of gradients that may be DTensor shards.

    Each DTensor contributes the squared norm of its local shard, summed over the mesh axes it is
    sharded on (Replicate axes hold copies: counted once); a Partial gradient is reduced first. One
    foreach norm and one all-reduce per (mesh, sharded axes) group, then one over pipeline stages; no
    host sync.
    """
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        if hasattr(g, "placements"):
            if any(p.is_partial() for p in g.placements):
                from torch.distributed.tensor import Replicate

                g = g.redistribute(g.device_mesh, [Replicate() if p.is_partial() else p for p in g.placements])
            # Shard and _StridedShard (FSDP over TP; its is_shard() is False) both split the tensor.
            dims = tuple(i for i, p in enumerate(g.placements) if not p.is_replicate())
            key, local = (g.device_mesh, dims, g.dtype), g.to_local()
        else:
            key, local = (None, (), g.dtype), g
        groups.setdefault(key, []).append(local)
    device = grads[0].device if grads else torch.device("cpu")
    total_sq = torch.zeros((), dtype=torch.float32, device=device)
    # Insertion order follows the parameters, so every rank runs the same collectives in the same order.
    for (mesh, dims, _), tensors in groups.items():
        norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
        sq = torch.stack(norms).square().sum()
        for d in dims:
            if mesh.size(d) > 1:
                dist.all_reduce(sq, group=mesh.get_group(d))
        total_sq = total_sq + sq.to(device)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total_sq, group=pp_group)
    return total_sq.sqrt()


@torch.no_grad()
def clip_grad_norm(params: Sequence[nn.Parameter], max_norm: float, *, pp_group=None,
                   skip: nn.Parameter | None = None, grad_scale: float = 1.0, sync: bool = True) -> float | torch.Tensor:
    """Global L2 norm of the gradients, clipped to max_norm (0 = report only), as torch's clip_grad_norm_
    for any mix of DTensor (TP/FSDP shards) and plain gradients, summed over pipeline stages; `skip` is
    a second copy of a tied weight, counted once (and clipped like the rest). One host sync: the norm.

    `grad_scale` is a loss scale the gradients still carry: the norm is reported without it, and the
    gradients are unscaled in the same multiply that clips them. With sync=False the norm is returned as a
    0-d device tensor and nothing waits for the GPU.
    """
    with_grad = [p for p in params if p.grad is not None]
    grads = [p.grad for p in with_grad if p is not skip]
    total = total_grad_norm(grads, pp_group=pp_group)
    if grad_scale != 1.0:
        total = total / grad_scale                  # a power of two: exact
    if (max_norm > 0 or grad_scale != 1.0) and with_grad:
        # On the local shards, on the device: coef = min(1, max_norm / (norm + 1e-6)) / grad_scale; a
        # non-finite norm scales by nan (or 0), and the step is then skipped and the gradients dropped.
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0) if max_norm > 0 else torch.ones_like(total)
        if grad_scale != 1.0:
            coef = coef / grad_scale
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for p in with_grad:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            by_device.setdefault(g.device, []).append(g)
        for dev, local in by_device.items():
            torch._foreach_mul_(local, coef.to(dev))
    return float(total) if sync else total


class DynamicLossScaler:
    """Dynamic loss scaling for fp16 compute, with torch.amp.GradScaler's rule, defaults and state_dict keys:
    the loss is multiplied by `scale` before backward; a step whose gradients overflow is skipped and the
    scale multiplied by backoff_factor; after growth_interval finite steps in a row it is multiplied by
    growth_factor.

    Why not GradScaler itself: its inf check runs per optimizer over local gradients (DTensor reduces it
    over one mesh per foreach call, so lists may not mix meshes or plain tensors) and never across pipeline
    stages, and `step` reads it on the host a second time. Here the overflow check is the global grad norm
    (`clip_grad_norm`), already reduced over every mesh axis and every stage and read once per step: any
    inf/nan gradient makes it non-finite, and every rank takes the same decision.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise ValueError(f"loss scaler: need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, "
                             f"growth_interval >= 1 (got {init_scale}, {growth_factor}, {backoff_factor}, "
                             f"{growth_interval})")
        self.scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self._growth_tracker = 0

    def update(self, found_inf: bool) -> None:
        """After each optimizer step (taken or skipped): back off on overflow, grow after a run of good steps."""
        if found_inf:
            self.scale *= self.backoff_factor
            self._growth_tracker = 0
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self._growth_tracker = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self._growth_tracker = int(state["_growth_tracker"])


def apply_hyperparams(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR,
                      cfg: OptimSection, *, reset_schedule: bool) -> None:
    """Sets a run's AdamW hyperparameters and lr schedule on a live optimizer, keeping its moments.

    reset_schedule (a new run) restarts the schedule at step 0, as a freshly built LambdaLR; otherwise (a
    resumed run) the schedule keeps its step and only its shape and peak change."""
    if reset_schedule:
        scheduler.last_epoch = 0
    fn = lr_lambda(cfg)
    scheduler.lr_lambdas = [fn for _ in optimizer.param_groups]
    scheduler.base_lrs = [cfg.lr for _ in optimizer.param_groups]
    for group in optimizer.param_groups:
        group.update(initial_lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
        group["lr"] = cfg.lr * fn(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def settings_in_effect(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR,
                       cfg: OptimSection) -> OptimSection:
    """A live optimizer's run settings, read back from AdamW's first group and the schedule's base lr (the rest
    from the section the schedule follows): what ConfigureRun answers."""
    group = optimizer.param_groups[0]
    return OptimSection(lr=scheduler.base_lrs[0], weight_decay=group["weight_decay"], betas=tuple(group["betas"]),
                        eps=group["eps"], grad_clip=cfg.grad_clip, lr_schedule=cfg.lr_schedule,
                        warmup_steps=cfg.warmup_steps, total_steps=cfg.total_steps, min_lr_ratio=cfg.min_lr_ratio)
