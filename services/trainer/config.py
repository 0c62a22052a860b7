"""The trainer's settings: the `actor:`, `critic:` and `weight_sync:` sections, validated before anything runs."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from services.common.config import MeshSettings, ModelConfig, Section, ServerConfig
from services.common.weights import DEFAULT_BUCKET_BYTES

DType = Literal["float32", "bfloat16", "float16"]
# Schedules that run several stages per rank.
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b",)


def check_microbatches(schedule: str, num_microbatches: int, pp_size: int) -> None:
    """Interleaved 1F1B runs micro-batches in rounds of pp_size: their count must split into whole rounds
    (torch's ScheduleInterleaved1F1B: max(1, n // pp) rounds must divide n)."""
    if schedule != "interleaved_1f1b" or pp_size == 1:
        return
    rounds = max(1, num_microbatches // pp_size)
    if num_microbatches % rounds:
        raise ValueError(f"actor.num_microbatches: interleaved_1f1b runs micro-batches in {rounds} rounds of "
                         f"pp_size={pp_size}; {num_microbatches} does not split into them (use a multiple of "
                         f"{pp_size}, or fewer than {2 * pp_size})")


def check_mesh(tp: int, pp: int, dp: int, world_size: int, *, launch: str) -> None:
    """tp_size * pp_size * dp_size must be the trainer's rank count (`launch` says where that count is set);
    the ValueError gives the dp_size that fits, or says that none does."""
    if tp * pp * dp == world_size:
        return
    if world_size % (tp * pp) == 0:
        advice = f"set actor.dp_size to {world_size // (tp * pp)}, or change {launch}"
    else:
        advice = (f"no actor.dp_size fits: make {launch} a multiple of tp_size * pp_size = {tp * pp}, "
                  f"or lower actor.tp_size / actor.pp_size")
    raise ValueError(f"actor.tp_size * actor.pp_size * actor.dp_size = {tp} * {pp} * {dp} = {tp * pp * dp}, "
                     f"but the trainer has {world_size} rank(s) ({launch}); {advice}")


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
    # Response log-probs and entropy through the fused LM head (services/common/fused.py): no fp32
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
