"""Trainer engine: the actor (and optional critic) on the device mesh, PPO updates, checkpoints, export.

SPMD: rank 0 validates each command, broadcasts it over the CommandChannel and runs it like every
other rank (`_local_<command>`); ranks > 0 sit in `serve_workers`. Each rank trains on its DP
shard of every mini-batch; results come back to rank 0. One process is the world-size-1 case of
the same code. No gRPC here.
"""

from __future__ import annotations

import copy
import logging
import math
import shutil
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

import numpy as np
import torch
import torch.distributed as dist
from pydantic import Field, model_validator
from torch import nn

from services.common.codec import DTYPES
from services.common.config import MeshSettings, ModelConfig, Section, ServerConfig
from services.common.errors import FailedPrecondition, NotFound
from services.common.modeling import (load_causal_lm, pack_by_token_budget, pad_batch, response_logprobs,
                                      set_threads, validate_sequences)
from services.common.weights import DEFAULT_BUCKET_BYTES, named_weights
from services.trainer import checkpoint
from services.trainer.batch import (ActorLoss, CriticLoss, CriticSample, DPOLoss, PreferencePair, TrainSample,
                                    is_on_policy, mini_batches, validate_actor_batch, validate_critic_batch,
                                    validate_dpo_batch)
from services.trainer.dpo import dpo_loss
from services.trainer.fused import enable_fused_head, fused_response_logprobs, host_to_device, supports_fused_head
from services.trainer.nvtx import phase
from services.trainer.losses import aggregate, clipped_policy_loss, clipped_value_loss, kl_penalty
from services.trainer.optim import DynamicLossScaler, build_adamw, clip_grad_norm
from services.trainer.parallel import (CommandChannel, ParallelDims, all_reduce_sum, gather_to_rank0,
                                       init_distributed, launched_world_size, local_device)
from services.trainer.parallelize import parallelize
from services.trainer.pipeline import MULTI_STAGE_SCHEDULES, build_schedule, check_microbatches, tied_embedding

log = logging.getLogger("meshrl.trainer")

DType = Literal["float32", "bfloat16", "float16"]


class OptimSection(Section):
    """AdamW and its learning-rate schedule."""

    lr: float = Field(1e-6, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    # Max global gradient norm; 0 turns clipping off (the norm is still reported).
    grad_clip: float = Field(1.0, ge=0)
    lr_schedule: Literal["constant", "cosine"] = "constant"
    # Linear warm-up from lr / warmup_steps to lr over this many optimizer steps.
    warmup_steps: int = Field(0, ge=0)
    # Cosine: optimizer steps from the end of warm-up to min_lr_ratio * lr.
    total_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    # Micro-batches are packed so that batch * longest sequence stays within this many tokens.
    micro_batch_token_budget: int = Field(16384, ge=1)

    @model_validator(mode="after")
    def _cosine_needs_steps(self):
        if self.lr_schedule == "cosine" and self.total_steps <= self.warmup_steps:
            raise ValueError(f"total_steps: the cosine schedule needs total_steps > warmup_steps "
                             f"({self.total_steps} <= {self.warmup_steps})")
        for b in self.betas:
            if not 0 <= b < 1:
                raise ValueError(f"betas: each must be in [0, 1), got {list(self.betas)}")
        return self


class ActorConfig(OptimSection):
    """`actor:` section: the policy being trained, its optimizer and its mesh."""

    # Defaults to model.path (the initial policy).
    model_path: str | None = None
    tp_size: int = Field(1, ge=1)
    pp_size: int = Field(1, ge=1)
    dp_size: int = Field(1, ge=1)
    dp_mode: Literal["fsdp", "ddp"] = "fsdp"
    # Pipeline parallel: micro-batches per mini-batch and DP rank (default pp_size), and their schedule.
    num_microbatches: int | None = Field(None, ge=1)
    pipeline_schedule: Literal["1f1b", "gpipe", "interleaved_1f1b"] = "1f1b"
    # Pipeline stages (virtual stages) per rank: interleaved_1f1b only (default 2); 1f1b and gpipe hold one.
    pp_stages_per_rank: int | None = Field(None, ge=1)
    activation_checkpointing: bool = False
    # torch.compile each decoder block (regional: one compiled graph serves every block). Default (null):
    # on for CUDA, off elsewhere.
    compile: bool | None = None
    # Response log-probs and entropy through the fused LM head (services/trainer/fused.py): no fp32
    # [tokens, vocab] tensors; Triton kernels on CUDA, a chunked pure-torch path elsewhere. Default
    # (null): on for CUDA, off elsewhere. Models it cannot fuse (TP-sharded or biased heads, soft-capped
    # logits) and pipeline stages use the plain path.
    fused_logprobs: bool | None = None
    # Master weights and optimizer state; defaults to model.dtype.
    param_dtype: DType | None = None
    # Forward/backward dtype; defaults to param_dtype. float16 turns on dynamic loss scaling (below).
    dtype: DType | None = None
    # fp16 loss scaling (actor and critic): initial scale, and finite steps in a row before it doubles; an
    # overflowing step is skipped and halves it (torch.amp.GradScaler's defaults and rule).
    loss_scale_init: float = Field(2.0 ** 16, gt=0)
    loss_scale_growth_interval: int = Field(2000, ge=1)
    seed: int = 0
    # Shuffle the batch before cutting it into mini-batches (seeded by seed, step and epoch).
    shuffle: bool = True
    # Samples per TrainActor / ComputeLogProbs call.
    max_batch_size: int = Field(8192, ge=1)
    # Weights are cast to this dtype for rollout replicas (default: param_dtype).
    weight_sync_dtype: DType | None = None
    weight_bucket_bytes: int = Field(DEFAULT_BUCKET_BYTES, ge=1024)

    @property
    def stages_per_rank(self) -> int:
        return self.pp_stages_per_rank or (2 if self.pipeline_schedule in MULTI_STAGE_SCHEDULES else 1)

    @model_validator(mode="after")
    def _pipeline_stages(self):
        interleaved = self.pipeline_schedule in MULTI_STAGE_SCHEDULES
        if self.pp_stages_per_rank is not None and self.pp_stages_per_rank > 1 and not interleaved:
            raise ValueError(f"pp_stages_per_rank: {self.pp_stages_per_rank} stages per rank need pipeline_schedule "
                             f"interleaved_1f1b ({self.pipeline_schedule} runs one stage per rank)")
        if interleaved and self.pp_stages_per_rank == 1:
            raise ValueError("pp_stages_per_rank: interleaved_1f1b needs at least 2 stages per rank, got 1 "
                             "(use pipeline_schedule 1f1b for one)")
        check_microbatches(self.pipeline_schedule, self.num_microbatches or self.pp_size, self.pp_size)
        if self.dp_mode == "ddp" and self.dp_size > 1 and self.pp_size > 1:
            # A pipeline stage runs several micro-batch forwards before their backwards and wraps only the
            # backwards in no_sync; DDP's reducer then sees each parameter ready twice and fails.
            raise ValueError("dp_mode: ddp cannot be combined with pipeline parallel (pp_size > 1 and dp_size > 1); "
                             "use dp_mode fsdp")
        return self


class CriticConfig(OptimSection):
    """`critic:` section (PPO): a value head on the actor's architecture, with its own optimizer."""

    lr: float = Field(1e-5, gt=0)
    # Defaults to actor.model_path / model.path.
    model_path: str | None = None


class WeightSyncConfig(Section):
    """`weight_sync:` section: how PushWeights moves the actor's weights to rollout replicas."""

    # grpc: a CRC-checked stream, any host and engine. ipc: CUDA IPC handles, trainer and replicas on one GPU.
    # nccl: one NCCL communicator of rank 0 and every replica's GPU (needs CuPy), broadcast.
    transport: Literal["grpc", "ipc", "nccl"] = "grpc"
    # Bucket size of ipc / nccl (device staging); grpc uses actor.weight_bucket_bytes. PushWeights'
    # bucket_bytes overrides both when set.
    device_bucket_bytes: int = Field(128 * 1024 * 1024, ge=1024 * 1024)
    # nccl: seconds for a group to form and for each update's broadcasts; past it the group is aborted, the
    # push fails and replicas keep their old version.
    collective_timeout_s: float = Field(120.0, gt=0)


class TrainerSettings(MeshSettings):
    model: ModelConfig = ModelConfig()
    actor: ActorConfig = ActorConfig()
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    # No critic unless the section is present (GRPO needs none).
    critic: CriticConfig | None = None
    server: ServerConfig = ServerConfig()


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

    def forward(self, input_ids, attention_mask):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
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


def _build_trained(name: str, module: nn.Module, mesh, cfg: OptimSection, actor: ActorConfig, param_dtype: str,
                   compute_dtype: str, *, compile: bool = False) -> Trained:
    stages = parallelize(module, mesh, dp_mode=actor.dp_mode, activation_checkpointing=actor.activation_checkpointing,
                         param_dtype=param_dtype, compute_dtype=compute_dtype, compile=compile,
                         stages_per_rank=actor.stages_per_rank)
    # Several stages per rank run only through the schedule; `module` holds their parameters.
    forward = stages[0] if len(stages) == 1 else module
    optimizer = build_adamw(module.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                            weight_decay=cfg.weight_decay, name=name)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    scaler = (DynamicLossScaler(actor.loss_scale_init, growth_interval=actor.loss_scale_growth_interval)
              if compute_dtype == "float16" else None)
    return Trained(name, module, forward, optimizer, scheduler, cfg, stages=stages, scaler=scaler)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective: every rank calls it), any other tensor as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, temperature: float):
    """modeling.response_logprobs' math on logits already taken at the response positions [B, R, V]."""
    logits = logits.float()
    if temperature and temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = torch.gather(logp_all, 2, targets.unsqueeze(-1)).squeeze(-1) * mask
    entropy = -(logp_all.exp() * logp_all).sum(-1) * mask
    return logp, entropy


STAT_KEYS = ("pg_loss", "kl_loss", "entropy_loss", "loss", "clipped", "approx_kl", "entropy", "tokens")


def actor_loss(logp, mask, entropy, old, adv, ref, loss: ActorLoss, denom: float):
    """Loss of one micro-batch (normalised by the whole mini-batch's `denom`) and its stats [8]."""
    pg, clipped = clipped_policy_loss(logp, old, adv, clip_low=loss.clip_low, clip_high=loss.clip_high,
                                      dual_clip=loss.dual_clip)
    pg_loss = aggregate(pg, mask, loss.loss_agg_mode, denom=denom)
    ent_loss = aggregate(entropy, mask, loss.loss_agg_mode, denom=denom)
    total = pg_loss - loss.entropy_coef * ent_loss
    kl_loss = torch.zeros((), device=logp.device)
    if ref is not None:
        kl_loss = aggregate(kl_penalty(logp, ref, loss.kl_type), mask, loss.loss_agg_mode, denom=denom)
        total = total + loss.kl_coef * kl_loss
    with torch.no_grad():
        # Stays on the device: read once per TrainActor call, not once per micro-batch.
        m = mask.float()
        stats = torch.stack([x.double() for x in (pg_loss, kl_loss, ent_loss, total, (clipped * m).sum(),
                                                  ((old - logp) * m).sum(), (entropy * m).sum(), m.sum())])
    return total, stats


DPO_STAT_KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracy", "logps/chosen",
                 "logps/rejected", "pairs", "tokens")


def dpo_pairs_loss(chosen, rejected, ref_chosen, ref_rejected, real, loss: DPOLoss, denom: float, num_tokens: float):
    """Loss of one micro-batch of pairs (summed log-probs [k]; `real` is 0 for padding pairs), normalised by
    the whole mini-batch's pair count `denom`, and its summed stats [9] (DPO_STAT_KEYS)."""
    per_pair, m = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=loss.beta, loss_type=loss.loss_type,
                           label_smoothing=loss.label_smoothing)                               # [k]
    total = (per_pair * real).sum() / denom
    with torch.no_grad():
        sums = [float((m[k] * real).sum()) for k in DPO_STAT_KEYS[1:7]]
        stats = torch.tensor([total.item(), *sums, float(real.sum()), num_tokens], dtype=torch.float64)
    return total, stats


# Commands that are one profiling phase as a whole; training commands mark forward_backward and optimizer inside.
COMMAND_PHASES = {"compute_logprobs": "logprobs", "compute_values": "values", "state_for_sync": "state_for_sync",
                  "export_hf": "export_hf", "save_checkpoint": "save_checkpoint", "load_checkpoint": "load_checkpoint"}


class TrainerEngine:
    """The trainer on one rank. Public methods are called on rank 0 and run on every rank."""

    def __init__(self, settings: TrainerSettings):
        a, m = settings.actor, settings.model
        if settings.critic is not None and a.pp_size > 1:
            raise ValueError("critic: a critic with actor.pp_size > 1 is not implemented yet")
        # The mesh is checked before anything heavy happens, so a bad launch fails in a second.
        self.dims = ParallelDims(dp=a.dp_size, pp=a.pp_size, tp=a.tp_size, world_size=launched_world_size())
        self.settings = settings
        self.cfg = a
        self.model_path = a.model_path or m.path
        if not (Path(self.model_path) / "config.json").is_file():
            raise ValueError(f"actor.model_path: {self.model_path!r} is not a Hugging Face model folder "
                             f"(no config.json)")
        self.param_dtype = a.param_dtype or m.dtype
        self.compute_dtype = a.dtype or self.param_dtype
        set_threads(m.num_threads)
        self.device = local_device(m.device)
        init_distributed(self.device.type)
        self.rank = dist.get_rank()
        self.mesh = self.dims.build_mesh(self.device.type)
        self.dp_mesh = self.mesh["dp"]
        self.dp_rank = self.dp_mesh.get_local_rank()
        self.dp_group = self.dp_mesh.get_group()
        self.pp_mesh = self.mesh["pp"]
        self.pp_group = self.pp_mesh.get_group()
        self.pp_rank = self.pp_mesh.get_local_rank()
        self.tp_rank = self.mesh["tp"].get_local_rank()
        self.is_last_stage = self.pp_rank == self.dims.pp - 1
        self.num_microbatches = a.num_microbatches or self.dims.pp
        self.channel = CommandChannel()
        # FSDP/DDP already mix in the compute dtype; autocast covers the unsharded case.
        self._autocast = self.compute_dtype != self.param_dtype and not (a.dp_mode == "fsdp" and self.dims.dp > 1)
        torch.manual_seed(a.seed)

        module = load_causal_lm(self.model_path, dtype=self.param_dtype, device=str(self.device), trainable=True)
        # No dropout in RL updates: at the first step of a batch the ratio to the old policy must be exactly 1.
        module.train(False)
        self.hf_config = copy.deepcopy(module.config)
        self.hf_config.architectures = [type(module).__name__]
        self.pad_id = module.config.pad_token_id or 0
        self.vocab_size = module.config.vocab_size
        self.max_len = getattr(module.config, "max_position_embeddings", None)
        on_cuda = self.device.type == "cuda"
        compile_blocks = on_cuda if a.compile is None else a.compile
        # Before parallelize: the check reads plain parameters, and the forward it installs is the one
        # FSDP's and DDP's wrappers then call.
        self.fused_logprobs = self._setup_fused_head(module, on_cuda if a.fused_logprobs is None else a.fused_logprobs)
        self.actor = _build_trained("actor", module, self.mesh, a, a, self.param_dtype, self.compute_dtype,
                                    compile=compile_blocks)
        # First and last pipeline stages each hold a tied embedding; their gradients are summed.
        self.tied = tied_embedding(module, self.pp_mesh)
        self.tied_group = self._build_tied_group()
        # The last optimizer step of a TrainActor call checks its gradient norm after the fact, with the
        # call's stats (fused AdamW only; see _optimizer_step); False checks before stepping, as every other step.
        self.defer_last_step = True
        self.critic: Trained | None = None
        if settings.critic is not None:
            self.critic = _build_trained("critic", self._load_value_model(settings.critic), self.mesh,
                                         settings.critic, a, self.param_dtype, self.compute_dtype,
                                         compile=compile_blocks)
        self.weight_version = 0
        self._lock = threading.Lock()
        self._closed = False
        devices = gather_to_rank0(str(self.device), self.channel.group)
        self.devices = ",".join(devices) if devices else str(self.device)
        log.info("Rank %d: actor loaded on %s (%s)", self.rank, self.device, self.dims.describe())
        if self.critic is not None:
            log.info("Rank %d: critic loaded on %s (%s)", self.rank, self.device, self.dims.describe())

    def _setup_fused_head(self, module: nn.Module, wanted: bool) -> bool:
        """Turns the fused head on where it applies; the plain path stays for pipeline stages and heads it
        cannot fuse (said once, in the log)."""
        if not wanted:
            return False
        reason = ("pipeline parallel" if self.dims.pp > 1 else
                  "tensor parallel (the head splits the vocabulary)" if self.dims.tp > 1 else
                  supports_fused_head(module))
        if reason is not None:
            if self.rank == 0:
                log.info("actor.fused_logprobs: plain log-prob path (%s)", reason)
            return False
        enable_fused_head(module)
        return True

    def _load_value_model(self, cfg: CriticConfig) -> ValueModel:
        from transformers import AutoModel

        path = cfg.model_path or self.model_path
        backbone = AutoModel.from_pretrained(path, dtype=DTYPES[self.param_dtype], local_files_only=True)
        model = ValueModel(backbone, backbone.config.hidden_size).to(device=self.device, dtype=DTYPES[self.param_dtype])
        model.train(False)
        return model

    # ---- commands (rank 0) ------------------------------------------------------------------------

    def _run(self, name: str, *args) -> Any:
        """Broadcasts the command and runs it here too; the lock keeps every rank's command order equal."""
        with self._lock:
            if self._closed:
                raise FailedPrecondition("trainer is shut down")
            self.channel.send((name, args))
            return self._local(name, args)

    def _local(self, name: str, args) -> Any:
        """Runs a command on this rank, inside its NVTX range where it is one phase (nvtx.PHASES)."""
        with phase(COMMAND_PHASES[name]) if name in COMMAND_PHASES else nullcontext():
            return getattr(self, f"_local_{name}")(*args)

    def compute_logprobs(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                         temperature: float = 1.0) -> list[list[float]]:
        self._check_sequences(prompts, responses)
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature: must be > 0, got {temperature}")
        return self._run("compute_logprobs", [list(p) for p in prompts], [list(r) for r in responses], temperature)

    def compute_values(self, prompts, responses) -> list[list[float]]:
        self._require_critic()
        self._check_sequences(prompts, responses)
        return self._run("compute_values", [list(p) for p in prompts], [list(r) for r in responses])

    def train_actor(self, samples: Sequence[TrainSample], loss: ActorLoss) -> dict[str, float]:
        if len(samples) > self.cfg.max_batch_size:
            raise ValueError(f"samples: {len(samples)} exceed actor.max_batch_size={self.cfg.max_batch_size}")
        validate_actor_batch(samples, loss, vocab_size=self.vocab_size, max_len=self.max_len, dp_size=self.dims.dp)
        return self._run("train_actor", list(samples), loss)

    def train_dpo(self, pairs: Sequence[PreferencePair], loss: DPOLoss) -> dict[str, float]:
        """One preference update (DPO / IPO / cDPO) over mini-batches of pairs; bumps the weight version."""
        if len(pairs) > self.cfg.max_batch_size:
            raise ValueError(f"pairs: {len(pairs)} exceed actor.max_batch_size={self.cfg.max_batch_size}")
        validate_dpo_batch(pairs, loss, vocab_size=self.vocab_size, max_len=self.max_len, dp_size=self.dims.dp)
        return self._run("train_dpo", list(pairs), loss)

    def train_critic(self, samples: Sequence[CriticSample], loss: CriticLoss) -> dict[str, float]:
        self._require_critic()
        if len(samples) > self.cfg.max_batch_size:
            raise ValueError(f"samples: {len(samples)} exceed actor.max_batch_size={self.cfg.max_batch_size}")
        validate_critic_batch(samples, loss, vocab_size=self.vocab_size, max_len=self.max_len, dp_size=self.dims.dp)
        return self._run("train_critic", list(samples), loss)

    def state_for_sync(self, on_device: bool = False) -> tuple[dict[str, torch.Tensor], int]:
        """Full copies of the actor's weights (HF names, no tied duplicates) and their version: on CPU, or on
        rank 0's device for the device transports (ipc, nccl)."""
        if on_device and self.device.type != "cuda":
            raise FailedPrecondition(f"weight_sync.transport: ipc and nccl need the trainer on a CUDA device, "
                                     f"it runs on {self.device}")
        return self._run("state_for_sync", on_device), self.weight_version

    def save_checkpoint(self, path: str) -> dict:
        if not path:
            raise ValueError("path: empty")
        self._run("save_checkpoint", path, self.weight_version)
        return {"path": path, "step": self.actor.step, "weight_version": self.weight_version}

    def load_checkpoint(self, path: str) -> dict:
        if not path:
            raise ValueError("path: empty")
        if not checkpoint.exists(path):
            raise NotFound(f"path: no trainer checkpoint at {path!r}")
        meta = checkpoint.read_meta(path)
        if bool(meta.get("has_critic")) != (self.critic is not None):
            raise FailedPrecondition(f"path: checkpoint {'has' if meta.get('has_critic') else 'has no'} critic, "
                                     f"this trainer {'has' if self.critic else 'has none'}")
        self._run("load_checkpoint", path)
        return {"path": path, "step": self.actor.step, "weight_version": self.weight_version}

    def export_hf(self, path: str) -> dict:
        if not path:
            raise ValueError("path: empty")
        self._run("export_hf", path)
        return {"path": path, "step": self.actor.step, "weight_version": self.weight_version}

    def bubble_fraction(self) -> float:
        """Idle share of a pipeline step: (pp - 1) / (v * microbatches + pp - 1) with v stages per rank (1 under
        GPipe/1F1B; interleaving shrinks the bubble v times); 0 without PP."""
        pp, v = self.dims.pp, len(self.actor.stages)
        return (pp - 1) / (v * self.num_microbatches + pp - 1)

    def info(self) -> dict:
        return {"tp": self.dims.tp, "pp": self.dims.pp, "dp": self.dims.dp, "world_size": self.dims.world_size,
                "devices": self.devices, "step": self.actor.step, "dtype": self.compute_dtype,
                "param_dtype": self.param_dtype, "dp_mode": self.cfg.dp_mode,
                "pipeline_schedule": self.cfg.pipeline_schedule, "num_microbatches": self.num_microbatches,
                "pp_stages_per_rank": len(self.actor.stages),
                "critic": self.critic is not None, "critic_step": self.critic.step if self.critic else 0,
                "micro_batch_token_budget": self.cfg.micro_batch_token_budget, "max_model_len": self.max_len}

    def close(self) -> None:
        """Releases ranks > 0 from their loop; the engine takes no commands afterwards."""
        with self._lock:
            if not self._closed and self.rank == 0:
                self.channel.send(("shutdown", ()))
            self._closed = True

    def serve_workers(self) -> None:
        """The loop of ranks > 0: run each command rank 0 broadcasts until it says shutdown."""
        while True:
            name, args = self.channel.receive()
            if name == "shutdown":
                return
            try:
                self._local(name, args)
            except Exception:  # noqa: BLE001 - rank 0 validated the input; keep serving and say why
                log.exception("Rank %d: command %s failed", self.rank, name)

    def _require_critic(self) -> None:
        if self.critic is None:
            raise FailedPrecondition("no critic configured (add a `critic:` section to the trainer config)")

    def _check_sequences(self, prompts, responses) -> None:
        validate_sequences(prompts, responses, vocab_size=self.vocab_size, max_len=self.max_len)
        if len(prompts) > self.cfg.max_batch_size:
            raise ValueError(f"sequences: {len(prompts)} exceed actor.max_batch_size={self.cfg.max_batch_size}")

    # ---- per-rank work ----------------------------------------------------------------------------

    def _amp(self):
        return torch.autocast(self.device.type, dtype=DTYPES[self.compute_dtype]) if self._autocast else nullcontext()

    def _local_groups(self, indices: Sequence[int], lengths: Sequence[int], budget: int) -> list[list[int] | None]:
        """This DP rank's shard of `indices` packed by token budget, padded with None (a zero-weight
        dummy micro-batch) so that every DP rank runs as many forwards as the busiest one: FSDP's
        collectives must line up. Every rank holds the whole batch, so this needs no communication.
        """
        packed = []
        for r in range(self.dims.dp):
            shard = list(indices[r::self.dims.dp])
            packed.append([[shard[j] for j in g] for g in pack_by_token_budget([lengths[i] for i in shard], budget)])
        mine: list[list[int] | None] = list(packed[self.dp_rank])
        return mine + [None] * (max(len(p) for p in packed) - len(mine))

    def _group_ids(self, group: list[int] | None, prompts, responses):
        if group is None:
            return [[self.pad_id]], [[self.pad_id]]
        return [prompts[i] for i in group], [responses[i] for i in group]

    def _merge_on_rank0(self, part: dict[int, list[float]], n: int) -> list[list[float]] | None:
        parts = gather_to_rank0(part, self.channel.group)
        if parts is None:
            return None
        merged: dict[int, list[float]] = {}
        for p in parts:
            merged.update(p)
        return [merged[i] for i in range(n)]

    @torch.no_grad()
    def _local_compute_logprobs(self, prompts, responses, temperature: float):
        # Same packing and forward as services.common.modeling.batched_logprobs, so a one-rank trainer
        # and the reference service agree bit for bit on the same weights.
        if self.dims.pp > 1:
            return self._merge_on_rank0(self._pp_logprobs(prompts, responses, temperature), len(prompts))
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
        out: dict[int, list[float]] = {}
        for group in self._local_groups(range(len(prompts)), lengths, self.cfg.micro_batch_token_budget):
            ps, rs = self._group_ids(group, prompts, responses)
            with self._amp():
                logp, _ = response_logprobs(self.actor.forward, ps, rs, pad_id=self.pad_id, temperature=temperature)
            logp = logp.cpu()
            for row, i in enumerate(group or []):
                out[i] = logp[row, :len(responses[i])].tolist()
        return self._merge_on_rank0(out, len(prompts))

    def _values(self, model: nn.Module, prompts, responses) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids, attention_mask, positions, mask, _ = pad_batch(prompts, responses, pad_id=self.pad_id,
                                                                  device=self.device)
        with self._amp():
            values = model(input_ids=input_ids, attention_mask=attention_mask)                 # [B, L]
        return torch.gather(values.float(), 1, positions) * mask, mask                          # [B, R]

    @torch.no_grad()
    def _local_compute_values(self, prompts, responses):
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
        out: dict[int, list[float]] = {}
        for group in self._local_groups(range(len(prompts)), lengths, self.critic.cfg.micro_batch_token_budget):
            ps, rs = self._group_ids(group, prompts, responses)
            values, _ = self._values(self.critic.forward, ps, rs)
            values = values.cpu()
            for row, i in enumerate(group or []):
                out[i] = values[row, :len(responses[i])].tolist()
        return self._merge_on_rank0(out, len(prompts))

    def _order(self, n: int, epoch: int, trained: Trained) -> list[int]:
        if not self.cfg.shuffle:
            return list(range(n))
        # Seeded by (seed, step, epoch): identical on every rank, and after a checkpoint restore.
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + trained.step * 1009 + epoch)
        return torch.randperm(n, generator=g).tolist()

    def _padded(self, rows: list[list[float]], width: int) -> torch.Tensor:
        out = np.zeros((len(rows), width), dtype=np.float32)
        for i, r in enumerate(rows):
            out[i, :len(r)] = r
        return host_to_device(torch.from_numpy(out), self.device)

    def _optimizer_step(self, trained: Trained, *, defer: bool = False) -> tuple[float | torch.Tensor, float, bool | None]:
        """Clips, steps and schedules; a non-finite gradient norm skips the step (weights stay).

        defer=True (the call's last step) with a fused AdamW and no loss scaler: nothing waits for the GPU.
        The norm stays a device tensor, the fused kernel gets `found_inf` (non-finite norm) and leaves the
        weights and its state alone when set; ok is None and `_finish_deferred` steps the scheduler (or
        counts the skip) once the caller has read the norm with its other results, in one host sync."""
        with phase("optimizer"):
            if defer and trained.scaler is None and trained.optimizer.defaults.get("fused"):
                return self._deferred_step(trained)
            return self._step(trained)

    def _clip(self, trained: Trained, *, sync: bool = True) -> float | torch.Tensor:
        """The global grad norm, clipped (and fp16-unscaled) in place; a device tensor with sync=False."""
        params = [p for p in trained.module.parameters() if p.requires_grad]
        skip = self.tied if (self.tied is not None and self.pp_rank != 0) else None
        return clip_grad_norm(params, trained.cfg.grad_clip, pp_group=self.pp_group, skip=skip,
                              grad_scale=trained.loss_scale, sync=sync)

    def _deferred_step(self, trained: Trained) -> tuple[torch.Tensor, float, None]:
        norm = self._clip(trained, sync=False)
        lr = trained.optimizer.param_groups[0]["lr"]
        trained.optimizer.found_inf = (~torch.isfinite(norm)).float()
        try:
            trained.optimizer.step()
        finally:
            del trained.optimizer.found_inf
        trained.optimizer.zero_grad(set_to_none=True)
        return norm, lr, None

    @staticmethod
    def _finish_deferred(trained: Trained, norm: float) -> bool:
        ok = math.isfinite(norm)
        if ok:
            trained.scheduler.step()
            trained.step += 1
        return ok

    def _step(self, trained: Trained) -> tuple[float, float, bool]:
        norm = self._clip(trained)
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

    def _local_train_actor(self, samples: list[TrainSample], loss: ActorLoss) -> dict[str, float]:
        t0 = time.perf_counter()
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        use_kl = loss.kl_coef > 0 or all(len(s.ref_logprobs) == len(s.response_ids) for s in samples)
        # Summed over mini-batches: pg, kl, entropy-loss, total; over tokens: clipped, approx-kl, entropy, count.
        # This rank's part, on the device; summed over ranks once at the end (every sum is linear).
        local = torch.zeros(len(STAT_KEYS), dtype=torch.float64, device=self.device)
        norms, lrs, num_steps, num_mini, skipped = [], [], 0, 0, 0
        batches = mini_batches(len(samples), loss.mini_batch_size)
        pending = None
        for epoch in range(loss.ppo_epochs):
            order = self._order(len(samples), epoch, self.actor)
            for k, mb in enumerate(batches):
                idx = [order[j] for j in mb]
                with phase("forward_backward"):
                    local += self._actor_mini_batch(samples, idx, lengths, loss, use_kl)
                last = epoch == loss.ppo_epochs - 1 and k == len(batches) - 1
                norm, lr, ok = self._optimizer_step(self.actor, defer=last and self.defer_last_step)
                lrs.append(lr)
                num_mini += 1
                if ok is None:
                    pending = norm
                    continue
                norms.append(norm)
                num_steps += ok
                skipped += not ok
        if pending is not None:
            # The stats and the last step's norm in one read: the only wait for the GPU in this call.
            *stats, norm = torch.cat([local, pending.to(local.dtype).reshape(1)]).tolist()
            ok = self._finish_deferred(self.actor, norm)
            norms.append(norm)
            num_steps += ok
            skipped += not ok
        else:
            stats = local.tolist()
        summed = all_reduce_sum(all_reduce_sum(stats, group=self.pp_group), group=self.dp_group)
        totals = dict(zip(STAT_KEYS, summed))
        self.weight_version += 1
        seconds = time.perf_counter() - t0
        tokens = totals["tokens"]
        return {
            "pg_loss": totals["pg_loss"] / num_mini, "kl_loss": totals["kl_loss"] / num_mini,
            "entropy_loss": totals["entropy_loss"] / num_mini, "loss": totals["loss"] / num_mini,
            "entropy": totals["entropy"] / max(tokens, 1), "clip_frac": totals["clipped"] / max(tokens, 1),
            "approx_kl": totals["approx_kl"] / max(tokens, 1),
            "grad_norm": sum(norms) / len(norms), "lr": lrs[-1],
            "num_tokens": float(sum(len(s.response_ids) for s in samples)),
            "tokens_per_s": loss.ppo_epochs * sum(lengths) / max(seconds, 1e-9),
            "num_optimizer_steps": float(num_steps), "num_skipped_steps": float(skipped),
            "loss_scale": self.actor.loss_scale,
            "seconds": seconds, "pipeline_bubble_fraction": self.bubble_fraction(),
        }

    def _actor_mini_batch(self, samples, idx, lengths, loss: ActorLoss, use_kl: bool) -> torch.Tensor:
        """Forward/backward of one mini-batch over this rank's micro-batches; returns this rank's stats
        [STAT_KEYS] on the device (the last pipeline stage holds them; other stages zeros)."""
        denom = (sum(len(samples[i].response_ids) for i in idx) if loss.loss_agg_mode == "token-mean" else len(idx))
        # FSDP and DDP average gradients over DP ranks; scaling by dp turns that into the sum over the
        # mini-batch, whose normaliser (denom) already counts every rank's tokens. The fp16 loss scale rides along.
        scale = float(self.dims.dp) * self.actor.loss_scale
        on_policy = is_on_policy(samples)
        if self.dims.pp > 1:
            stats = self._actor_pipeline(samples, idx, loss, use_kl, denom, scale)
        else:
            stats = torch.zeros(len(STAT_KEYS), dtype=torch.float64, device=self.device)
            groups = self._local_groups(idx, lengths, self.cfg.micro_batch_token_budget)
            for g, group in enumerate(groups):
                rows = [samples[i] for i in group] if group else [self._dummy_sample()]
                width = max(len(s.response_ids) for s in rows)
                with self._grad_sync(self.actor, last=g == len(groups) - 1):
                    with self._amp():
                        logp, mask, entropy = self._train_logprobs(
                            [s.prompt_ids for s in rows], [s.response_ids for s in rows], loss.temperature)
                    ref = self._padded([s.ref_logprobs for s in rows], width) if use_kl else None
                    old = logp.detach() if on_policy else self._padded([s.old_logprobs for s in rows], width)
                    total, st = actor_loss(logp, mask, entropy, old,
                                           self._padded([s.advantages for s in rows], width), ref, loss, denom)
                    weight = 1.0 if group else 0.0
                    (total * (weight * scale)).backward()
                stats += weight * st
        self._sync_tied_grads()
        return stats

    def _train_logprobs(self, prompts, responses, temperature: float):
        """(logp, mask, entropy) [B, R] of one micro-batch, with gradients: the fused head when on."""
        if self.fused_logprobs:
            return fused_response_logprobs(self.actor.forward, prompts, responses, pad_id=self.pad_id,
                                           device=self.device, temperature=temperature)
        return response_logprobs(self.actor.forward, prompts, responses, pad_id=self.pad_id, temperature=temperature,
                                 with_entropy=True)

    @staticmethod
    def _grad_sync(trained: Trained, *, last: bool):
        """DDP all-reduces once per optimizer step, on the last micro-batch (FSDP reduce-scatters each one
        to keep gradients sharded); a no-op without DDP."""
        no_sync = getattr(trained.forward, "no_sync", None)
        return nullcontext() if last or no_sync is None else no_sync()

    def _dummy_sample(self) -> TrainSample:
        return TrainSample([self.pad_id], [self.pad_id], [0.0], [0.0], [0.0])

    def _sync_tied_grads(self) -> None:
        """Sums the tied embedding's gradient over the first and last pipeline stages (no-op otherwise)."""
        if self.tied is None or self.tied.grad is None:
            return
        g = self.tied.grad
        if hasattr(g, "placements") and g.placements != self.tied.placements:
            # The vocab-parallel embedding's gradient can come back replicated; match the head's shards.
            g = g.redistribute(g.device_mesh, self.tied.placements)
            self.tied.grad = g
        dist.all_reduce(g.to_local() if hasattr(g, "to_local") else g, group=self.tied_group)

    def _build_tied_group(self):
        """A group of the first and last stage at each (dp, tp) coordinate; both shard the weight alike."""
        if self.dims.pp == 1 or not self.hf_config.tie_word_embeddings:
            return None
        ranks = self.mesh.mesh                                                     # [pp, dp, tp]
        mine = None
        for d in range(self.dims.dp):
            for t in range(self.dims.tp):
                pair = [int(ranks[0, d, t]), int(ranks[-1, d, t])]
                group = dist.new_group(pair)                      # every rank creates every group, in order
                if self.rank in pair:
                    mine = group
        return mine

    def _pp_rows(self, idx: Sequence[int]) -> list[int | None]:
        """This DP rank's rows of a pipelined batch, padded with None to a multiple of num_microbatches."""
        shard = list(idx[self.dp_rank::self.dims.dp])
        longest = max(len(idx[r::self.dims.dp]) for r in range(self.dims.dp))
        n = self.num_microbatches
        size = max(1, -(-longest // n)) * n          # same row count on every DP rank, divisible by n
        return shard + [None] * (size - len(shard))

    def _pp_inputs(self, rows: list[int | None], prompts, responses):
        ps = [prompts[i] if i is not None else [self.pad_id] for i in rows]
        rs = [responses[i] if i is not None else [self.pad_id] for i in rows]
        input_ids, _, positions, mask, targets = pad_batch(ps, rs, pad_id=self.pad_id, device=self.device)
        real = torch.tensor([i is not None for i in rows], device=self.device).unsqueeze(1)
        return input_ids, positions, mask & real, targets

    def _pp_run(self, schedule, input_ids, target=None, train=True):
        """Runs a schedule on this stage: the first feeds ids, the last gets the target; returns last outputs."""
        args = (input_ids,) if self.pp_rank == 0 else ()
        kwargs = {"target": target} if (self.is_last_stage and target is not None) else {}
        if train:
            return schedule.step(*args, **kwargs)
        return schedule.eval(*args, **kwargs)

    def _actor_pipeline(self, samples, idx, loss: ActorLoss, use_kl: bool, denom: float, scale: float):
        """One mini-batch through the pipeline schedule; the last stage computes the loss per micro-batch."""
        rows = self._pp_rows(idx)
        input_ids, positions, mask, targets = self._pp_inputs(
            rows, [s.prompt_ids for s in samples], [s.response_ids for s in samples])
        width = positions.shape[1]
        pick = lambda attr: self._padded([getattr(samples[i], attr) if i is not None else [0.0] for i in rows],  # noqa
                                         width)
        # Everything the loss needs per token rides in one target tensor, split into micro-batches with the ids.
        on_policy = is_on_policy(samples)
        target = torch.stack([positions.float(), targets.float(), mask.float(), pick("old_logprobs"),
                              pick("advantages"), pick("ref_logprobs") if use_kl else torch.zeros_like(mask.float())],
                             dim=-1)                                                            # [B, R, 6]
        calls: list[torch.Tensor] = []

        def loss_fn(logits, tgt):
            pos, tok, m = tgt[..., 0].long(), tgt[..., 1].long(), tgt[..., 2] > 0
            at = torch.gather(logits, 1, pos.unsqueeze(-1).expand(-1, -1, logits.size(-1)))
            logp, entropy = logprobs_from_logits(at, tok, m, loss.temperature)
            old = logp.detach() if on_policy else tgt[..., 3]
            total, st = actor_loss(logp, m, entropy, old, tgt[..., 4], tgt[..., 5] if use_kl else None, loss, denom)
            calls.append(st)
            return total * scale

        schedule = build_schedule(self.actor.stages, self.pp_mesh, self.device,
                                  num_microbatches=self.num_microbatches, schedule=self.cfg.pipeline_schedule,
                                  loss_fn=loss_fn)
        with self._amp():
            self._pp_run(schedule, input_ids, target, train=True)
        # A new stage first calls loss_fn once more to infer gradient shapes; the real calls come last.
        real = calls[-self.num_microbatches:] if self.is_last_stage else []
        return sum(real, torch.zeros(len(STAT_KEYS), dtype=torch.float64, device=self.device))

    @torch.no_grad()
    def _pp_logprobs(self, prompts, responses, temperature: float) -> dict[int, list[float]]:
        rows = self._pp_rows(list(range(len(prompts))))
        input_ids, positions, mask, targets = self._pp_inputs(rows, prompts, responses)
        schedule = build_schedule(self.actor.stages, self.pp_mesh, self.device,
                                  num_microbatches=self.num_microbatches, schedule=self.cfg.pipeline_schedule)
        with self._amp():
            logits = self._pp_run(schedule, input_ids, train=False)
        out: dict[int, list[float]] = {}
        if self.is_last_stage:
            at = torch.gather(logits, 1, positions.unsqueeze(-1).expand(-1, -1, logits.size(-1)))
            logp, _ = logprobs_from_logits(at, targets, mask, temperature)
            for row, i in enumerate(rows):
                if i is not None:
                    out[i] = logp[row, :len(responses[i])].cpu().tolist()
        return out

    def _local_train_dpo(self, pairs: list[PreferencePair], loss: DPOLoss) -> dict[str, float]:
        t0 = time.perf_counter()
        # A pair's chosen and rejected rows share a micro-batch (the loss needs both), so a pair costs two
        # rows of its longer sequence against the token budget.
        lengths = [2 * (len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids))) for p in pairs]
        totals = torch.zeros(len(DPO_STAT_KEYS), dtype=torch.float64)
        norms, lrs, num_steps, num_mini = [], [], 0, 0
        order = self._order(len(pairs), 0, self.actor)
        for mb in mini_batches(len(pairs), loss.mini_batch_size):
            idx = [order[j] for j in mb]
            with phase("forward_backward"):
                totals += self._dpo_mini_batch(pairs, idx, lengths, loss)
            norm, lr, ok = self._optimizer_step(self.actor)
            norms.append(norm)
            lrs.append(lr)
            num_steps += ok
            num_mini += 1
        self.weight_version += 1
        seconds = time.perf_counter() - t0
        t = dict(zip(DPO_STAT_KEYS, totals.tolist()))
        n = max(t["pairs"], 1.0)
        tokens = sum(2 * len(p.prompt_ids) + len(p.chosen_ids) + len(p.rejected_ids) for p in pairs)
        return {"loss": t["loss"] / num_mini,
                **{k: t[k] / n for k in DPO_STAT_KEYS[1:7]},
                "grad_norm": sum(norms) / len(norms), "lr": lrs[-1], "num_pairs": float(len(pairs)),
                "num_tokens": t["tokens"], "tokens_per_s": tokens / max(seconds, 1e-9),
                "num_optimizer_steps": float(num_steps), "num_skipped_steps": float(num_mini - num_steps),
                "loss_scale": self.actor.loss_scale,
                "seconds": seconds, "pipeline_bubble_fraction": self.bubble_fraction()}

    def _dpo_mini_batch(self, pairs: list[PreferencePair], idx: list[int], lengths: list[int],
                        loss: DPOLoss) -> torch.Tensor:
        """Forward/backward of one mini-batch of pairs over this rank's micro-batches; DP-summed stats [9].

        The DPO loss is not linear in the log-probs, but it is a sum over pairs; each micro-batch holds
        whole pairs and divides by the mini-batch's pair count, so micro-batches (and DP ranks, with the
        dp scale as in TrainActor) add up to exactly the mini-batch gradient.
        """
        denom, scale = float(len(idx)), float(self.dims.dp) * self.actor.loss_scale
        if self.dims.pp > 1:
            stats = self._dpo_pipeline(pairs, idx, loss, denom, scale)
        else:
            stats = torch.zeros(len(DPO_STAT_KEYS), dtype=torch.float64)
            groups = self._local_groups(idx, lengths, self.cfg.micro_batch_token_budget)
            for g, group in enumerate(groups):
                rows = [pairs[i] for i in group] if group else [self._dummy_pair()]
                k = len(rows)
                with self._grad_sync(self.actor, last=g == len(groups) - 1):
                    with self._amp():
                        # Chosen and rejected go through one forward: rows [0, k) and [k, 2k).
                        logp, mask = response_logprobs(
                            self.actor.forward, [p.prompt_ids for p in rows] * 2,
                            [p.chosen_ids for p in rows] + [p.rejected_ids for p in rows], pad_id=self.pad_id)
                    sums = logp.sum(-1)                                                         # [2k]
                    ref = torch.tensor([p.ref_chosen_logprob for p in rows] + [p.ref_rejected_logprob for p in rows],
                                       dtype=torch.float32, device=self.device)
                    real = torch.full((k,), 1.0 if group else 0.0, device=self.device)
                    total, st = dpo_pairs_loss(sums[:k], sums[k:], ref[:k], ref[k:], real, loss, denom,
                                               float(mask.sum()) if group else 0.0)
                    (total * scale).backward()
                stats += st
        self._sync_tied_grads()
        summed = all_reduce_sum(all_reduce_sum(stats.tolist(), group=self.pp_group), group=self.dp_group)
        return torch.tensor(summed, dtype=torch.float64)

    def _dummy_pair(self) -> PreferencePair:
        return PreferencePair([self.pad_id], [self.pad_id], [self.pad_id], 0.0, 0.0)

    def _dpo_pipeline(self, pairs: list[PreferencePair], idx: list[int], loss: DPOLoss, denom: float,
                      scale: float) -> torch.Tensor:
        """One mini-batch of pairs through the pipeline schedule. Rows are interleaved (chosen, rejected)
        and each DP rank's pair count is a multiple of num_microbatches, so every pipeline micro-batch
        (an equal split along the rows) holds whole pairs and the last stage computes their loss."""
        shard = self._pp_rows(idx)                                   # pairs, padded with None
        prompts, responses = [], []
        for i in shard:
            p = pairs[i] if i is not None else self._dummy_pair()
            prompts += [p.prompt_ids, p.prompt_ids]
            responses += [p.chosen_ids, p.rejected_ids]
        input_ids, _, positions, mask, targets = pad_batch(prompts, responses, pad_id=self.pad_id, device=self.device)
        real = torch.tensor([i is not None for i in shard for _ in range(2)], device=self.device)     # [2P]
        mask = mask & real.unsqueeze(1)
        ref = torch.tensor([v for i in shard for v in ((pairs[i].ref_chosen_logprob, pairs[i].ref_rejected_logprob)
                                                        if i is not None else (0.0, 0.0))], device=self.device)
        width = positions.shape[1]
        per_row = lambda x: x.float().unsqueeze(1).expand(-1, width)  # noqa: E731
        target = torch.stack([positions.float(), targets.float(), mask.float(), per_row(ref), per_row(real)],
                             dim=-1)                                                                   # [2P, R, 5]
        calls: list[torch.Tensor] = []

        def loss_fn(logits, tgt):
            pos, tok, m = tgt[..., 0].long(), tgt[..., 1].long(), tgt[..., 2] > 0
            at = torch.gather(logits, 1, pos.unsqueeze(-1).expand(-1, -1, logits.size(-1)))
            logp, _ = logprobs_from_logits(at, tok, m, 1.0)
            sums = logp.sum(-1).view(-1, 2)                                                   # [k, (chosen, rejected)]
            refs, reals = tgt[:, 0, 3].view(-1, 2), tgt[:, 0, 4].view(-1, 2)[:, 0]
            total, st = dpo_pairs_loss(sums[:, 0], sums[:, 1], refs[:, 0], refs[:, 1], reals, loss, denom,
                                       float(m.sum()))
            calls.append(st)
            return total * scale

        schedule = build_schedule(self.actor.stages, self.pp_mesh, self.device,
                                  num_microbatches=self.num_microbatches, schedule=self.cfg.pipeline_schedule,
                                  loss_fn=loss_fn)
        with self._amp():
            self._pp_run(schedule, input_ids, target, train=True)
        real_calls = calls[-self.num_microbatches:] if self.is_last_stage else []
        return sum(real_calls, torch.zeros(len(DPO_STAT_KEYS), dtype=torch.float64))

    def _local_train_critic(self, samples: list[CriticSample], loss: CriticLoss) -> dict[str, float]:
        t0 = time.perf_counter()
        critic = self.critic
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        totals = torch.zeros(4, dtype=torch.float64)   # vf_loss (per mini-batch), clipped, value sum, tokens
        norms, lrs, num_mini, num_steps = [], [], 0, 0
        for epoch in range(loss.ppo_epochs):
            order = self._order(len(samples), epoch, critic)
            for mb in mini_batches(len(samples), loss.mini_batch_size):
                idx = [order[j] for j in mb]
                denom = sum(len(samples[i].response_ids) for i in idx)
                stats = torch.zeros(4, dtype=torch.float64)
                with phase("forward_backward"):
                    groups = self._local_groups(idx, lengths, critic.cfg.micro_batch_token_budget)
                    for g, group in enumerate(groups):
                        rows = ([samples[i] for i in group] if group
                                else [CriticSample([self.pad_id], [self.pad_id], [0.0], [0.0])])
                        width = max(len(s.response_ids) for s in rows)
                        with self._grad_sync(critic, last=g == len(groups) - 1):
                            values, mask = self._values(critic.forward, [s.prompt_ids for s in rows],
                                                        [s.response_ids for s in rows])
                            returns = self._padded([s.returns for s in rows], width)
                            old = (self._padded([s.old_values for s in rows], width) if loss.clip_value > 0
                                   else values.detach())
                            vf, clipped = clipped_value_loss(values, old, returns, clip_value=loss.clip_value)
                            vf_loss = aggregate(vf, mask, "token-mean", denom=denom)
                            weight = 1.0 if group else 0.0
                            (vf_loss * (weight * self.dims.dp * critic.loss_scale)).backward()
                        m = mask.float()
                        stats += weight * torch.tensor([vf_loss.item(), (clipped * m).sum().item(),
                                                        (values.detach() * m).sum().item(), m.sum().item()],
                                                       dtype=torch.float64)
                totals += torch.tensor(all_reduce_sum(stats.tolist(), group=self.dp_group, device=self.device),
                                       dtype=torch.float64)
                norm, lr, ok = self._optimizer_step(critic)
                norms.append(norm)
                lrs.append(lr)
                num_steps += ok
                num_mini += 1
        tokens = max(float(totals[3]), 1.0)
        return {"vf_loss": float(totals[0]) / num_mini, "vf_clip_frac": float(totals[1]) / tokens,
                "values_mean": float(totals[2]) / tokens, "grad_norm": sum(norms) / len(norms), "lr": lrs[-1],
                "num_tokens": float(sum(len(s.response_ids) for s in samples)),
                "num_optimizer_steps": float(num_steps), "num_skipped_steps": float(num_mini - num_steps),
                "loss_scale": critic.loss_scale, "seconds": time.perf_counter() - t0}

    @torch.no_grad()
    def _full_weights(self, on_device: bool = False) -> dict[str, torch.Tensor] | None:
        """Every actor weight, full and on CPU (on_device: on rank 0's device), on rank 0 (None elsewhere):
        HF names, tied weights once.

        TP/FSDP shards are gathered by full_tensor() on every rank; pipeline stages then send their
        part to rank 0 (one sender per stage: the rank at dp = tp = 0).
        """
        dtype = DTYPES[self.cfg.weight_sync_dtype or self.param_dtype]
        # Pipeline stages meet on rank 0 through a CPU gather, so only a one-stage mesh stays on the device.
        where = self.device if on_device and self.dims.pp == 1 else "cpu"
        mine = {name: _full(t).detach().to(where, dtype=dtype, copy=True)
                for name, t in named_weights(self.actor.module).items()}
        if self.dims.world_size == 1:
            return mine
        sender = self.rank != 0 and self.dp_rank == 0 and self.tp_rank == 0
        parts = gather_to_rank0(mine if sender else None, self.channel.group)
        if parts is None:
            return None
        merged = dict(mine)
        for part in parts:
            merged.update(part or {})
        if self.hf_config.tie_word_embeddings:
            merged.pop("lm_head.weight", None)      # the last stage's copy of the tied embedding
        if on_device:
            merged = {name: t.to(self.device) for name, t in merged.items()}
        return merged

    def _local_state_for_sync(self, on_device: bool = False) -> dict[str, torch.Tensor] | None:
        return self._full_weights(on_device)

    def _models(self) -> list[Trained]:
        return [self.actor] + ([self.critic] if self.critic else [])

    def _local_save_checkpoint(self, path: str, weight_version: int) -> None:
        checkpoint.save(path, self._models(), weight_version=weight_version, rank=self.rank,
                        world_size=self.dims.world_size, mesh=self.dims.describe())

    def _local_load_checkpoint(self, path: str) -> None:
        aliases = {"lm_head.weight": "model.embed_tokens.weight"} if self.hf_config.tie_word_embeddings else {}
        self.weight_version = checkpoint.load(path, self._models(), rank=self.rank, aliases=aliases)

    def _local_export_hf(self, path: str) -> None:
        from safetensors.torch import save_file

        state = self._full_weights()
        if self.rank != 0:
            return
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
        # The config of the HF class as loaded (FSDP and pipeline stages change the live module, not it).
        self.hf_config.save_pretrained(out)
        for f in Path(self.model_path).iterdir():
            # Tokenizer, chat template, generation config, custom code: everything but weights and config.
            if f.is_file() and not (f.suffix in (".safetensors", ".bin", ".pt") or f.name.endswith(".index.json")
                                    or f.name == "config.json"):
                shutil.copy2(f, out / f.name)
        log.info("exported actor (step %d) to %s", self.actor.step, out)
