"""The trainer's settings: the `actor:`, `critic:` and `weight_sync:` sections, validated before anything runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from services.common.auto import AUTO, Auto
from services.common.config import (MeshSettings, ModelConfig, Section, ServerConfig, bool_choice,
                                   format_validation_error)
from services.common.manifest import DEFAULT_BUCKET_BYTES
from services.trainer.types import RunStart

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


HALF = ("bfloat16", "float16")


def master_and_compute_dtypes(actor: "ActorConfig", model_dtype: str) -> tuple[str, str]:
    """(param_dtype, compute_dtype) the trainer runs: fp32 master weights with half-precision compute when
    model.dtype is half and actor.param_dtype is unset; otherwise what the keys say."""
    if actor.param_dtype is None:
        param = "float32" if model_dtype in HALF else model_dtype
        return param, actor.dtype or model_dtype
    return actor.param_dtype, actor.dtype or (model_dtype if model_dtype in HALF else actor.param_dtype)


# The keys of OptimSection a run sets on a running trainer (ConfigureRun): the fields of the proto's OptimSettings,
# by the same names. micro_batch_token_budget stays the trainer's start value.
RUN_OPTIM_KEYS = ("lr", "weight_decay", "betas", "eps", "grad_clip", "lr_schedule", "warmup_steps", "total_steps",
                  "min_lr_ratio")


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
    # Tokens per micro-batch: the packed row's length (use_remove_padding), else batch * longest sequence
    # (a longer sequence runs alone).
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

    def with_run(self, run: OptimSection, section: str) -> OptimSection:
        """This section with a run's optimizer settings (ConfigureRun's RUN_OPTIM_KEYS of `run`, as they came off
        the wire: unchecked) in place of its own, validated as the YAML is; an error names the key (`actor.lr: ...`)."""
        try:
            return type(self)(**{**self.model_dump(), **{k: getattr(run, k) for k in RUN_OPTIM_KEYS}})
        except ValidationError as e:
            raise ValueError(format_validation_error(e, source="", section=section)) from None


@dataclass
class RunOptim:
    """What ConfigureRun sets (and answers with: the values in effect): the run's `actor:` and `critic:` sections,
    of which the trainer takes RUN_OPTIM_KEYS."""

    actor: OptimSection
    critic: OptimSection | None = None
    # A run starts: the schedule restarts at step 0. A run resumes: the schedule keeps its step.
    reset_schedule: bool = True
    # A run starts (never set when one resumes): its weights from `start`, optimizer state cleared. None: the
    # weights and optimizer state stay as they are.
    start: RunStart | None = None
    # In an answer: the lr of the actor's next optimizer step.
    actor_lr: float = 0.0
    # In an answer: where a start took the weights from, in words, and the weight version the trainer holds.
    started_from: str = ""
    weight_version: int = 0
    # "" = the run's weights; a named adapter (a concurrent run's): its optimizer settings alone.
    adapter: str = ""


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSection(Section):
    """`actor.lora:` train low-rank adapters (peft's LoRA) instead of every weight. The base model stays frozen
    in model.dtype; the reference policy is the base model with the adapters off; rollout replicas get the merged
    weights; ExportHF writes the adapters in peft's format (merged on request); checkpoints hold the adapters and
    their optimizer state, and name their base model."""

    rank: int = Field(8, ge=1)
    # The adapters' output is scaled by alpha / rank.
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    # Names (last part of the module path, as peft matches them) of the linear layers that get adapters.
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGETS), min_length=1)

    @field_validator("dropout")
    @classmethod
    def _no_dropout(cls, v: float) -> float:
        # The trainer runs the model without dropout (module.train(False): at a batch's first step the ratio to
        # the old policy must be exactly 1), so a dropout would be silently ignored: refused instead.
        if v != 0:
            raise ValueError(f"the trainer runs without dropout (the PPO ratio must be exactly 1 at a batch's first "
                             f"step); got {v}, leave it 0")
        return v


def check_lora_targets(model_path: str, lora: LoraSection, *, key: str = "actor.lora.target_modules") -> None:
    """Every target module name matches a linear layer of the model (read from its config, built on the meta
    device: nothing is loaded)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    linear = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    missing = [t for t in lora.target_modules if t not in linear]
    if missing:
        raise ValueError(f"{key}: {', '.join(map(repr, missing))} match no linear layer of the model "
                         f"(it has {', '.join(sorted(linear))})")


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
    # Per-block activation checkpointing: none; full (each chosen block keeps only its input and recomputes
    # its forward in backward; every activation_checkpointing_every-th block, default all); selective
    # (op-level, every block: matmul and attention outputs are kept, norms/activations/rotary recomputed).
    # true/false mean full/none.
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    activation_checkpointing_every: int = Field(1, ge=1)
    # torch.compile each decoder block (regional: one compiled graph serves every block). auto (or null): on for
    # CUDA, off elsewhere; compiled during the trainer's warm-up, before it serves.
    compile: bool | Auto | None = AUTO
    # Response log-probs and entropy through the fused LM head (services/common/tensors/fused.py): no fp32
    # [tokens, vocab] tensors; Triton kernels on CUDA, a chunked pure-torch path elsewhere, vocab-parallel
    # under TP, chunked on the last pipeline stage. auto (or null): on wherever the head can be fused
    # (not for biased heads or soft-capped logits); false runs the model's own full logits (the baseline).
    fused_logprobs: bool | Auto | None = AUTO
    # Remove padding (verl's use_remove_padding): each micro-batch runs as one packed row, position ids
    # restarting per sequence and attention confined to each (services/common/tensors/packing.py); micro-batches
    # are filled to micro_batch_token_budget tokens. auto (or null): on for bf16/fp16 compute on CUDA where the
    # model and mesh allow (faster than padded rows on one H200: bench/results/trainer_packing.json), off on
    # CPU and under actor.pp_size > 1; true under actor.pp_size > 1 is refused.
    use_remove_padding: bool | Auto | None = AUTO
    # Warm up before serving: with compile, one forward + backward (and one no-grad forward) at two packed
    # lengths, so torch.compile builds its dynamic-size graphs before the first step; gradients are dropped and
    # the weights, optimizer state and step count stay as they were.
    warmup: bool = True
    # Master weights, gradients and AdamW state. Default: float32 when model.dtype is bfloat16 or float16
    # (fp32 master weights, half-precision compute: 16 bytes/param), else model.dtype. `bfloat16` with
    # model.dtype bfloat16 trains in bf16 only (8 bytes/param). See docs/trainer.md.
    param_dtype: DType | None = None
    # Forward/backward dtype; defaults to model.dtype (to param_dtype when that is set and model.dtype is not
    # half). float16 turns on dynamic loss scaling (below).
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
    # Several LoRA runs on this trainer: how long an update waits for other runs' updates that are due to share its
    # pass, in passes (the mean seconds of this trainer's recent update passes), at most 1 s; 0 never waits
    # (services/trainer/coalesce.py TrainMerger, docs/many_runs.md).
    merge_wait_passes: float = Field(0.5, ge=0, le=4)
    # Weights are cast to this dtype for rollout replicas and ExportHF (default: model.dtype).
    weight_sync_dtype: DType | None = None
    weight_bucket_bytes: int = Field(DEFAULT_BUCKET_BYTES, ge=1024)
    # LoRA adapters instead of full fine-tuning (absent: every weight trains).
    lora: LoraSection | None = None

    # `true`/`false` (YAML or a `--actor.activation_checkpointing true` flag) are `full`/`none`.
    _checkpointing_bool = field_validator("activation_checkpointing", mode="before")(bool_choice("full", "none"))

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
        if self.lora is not None and (self.tp_size > 1 or self.pp_size > 1):
            raise ValueError("lora: LoRA runs with data parallel only (fsdp or ddp); tp_size and pp_size must be 1")
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
    # nccl: one NCCL communicator of rank 0 and every replica's GPU (needs CuPy), broadcast. auto: per replica,
    # from what it reports in GetInfo: ipc when it holds the trainer rank 0's GPU, nccl when it is on another GPU
    # of the same host (and CuPy's NCCL imports on both), grpc otherwise (a CPU trainer or replica, another host).
    transport: Literal["grpc", "ipc", "nccl", "auto"] = "auto"
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
