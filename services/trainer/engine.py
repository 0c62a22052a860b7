"""Trainer engine: the actor (and optional critic) on the device mesh, its updates, log-probs, checkpoints, export.

SPMD: rank 0 validates each command, broadcasts it over the CommandChannel and runs it like every
other rank (`COMMANDS`, name -> method); ranks > 0 sit in `serve_workers`. Each rank trains on its DP
shard of every mini-batch (services/trainer/updates); results come back to rank 0. One process is the
world-size-1 case of the same code. No gRPC here.
"""

from __future__ import annotations

import copy
import logging
import math
import shutil
import threading
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
from pydantic import ValidationError
from torch import nn

from services.common.auto import Resolved
from services.common.codec import DTYPES
from services.common.compile import warm_up_forward
from services.common.config import format_validation_error
from services.common.errors import FailedPrecondition, passes_through
from services.common.fused import enable_fused_head, sequence_logprobs, supports_fused_head
from services.common.modeling import load_causal_lm, set_threads, validate_sequences
from services.common.packing import enable_packing, supports_packing
from services.common.weights import named_weights
from services.trainer.model import checkpoint
from services.trainer.batch import validate_actor_batch, validate_critic_batch, validate_dpo_batch
from services.trainer.config import CriticConfig, TrainerSettings, check_lora_targets, master_and_compute_dtypes
from services.trainer.weights.gather import StageGatherer, stage_gatherers
from services.trainer.parallel.layout import RankLayout
from services.trainer.model.lora import adapters_off, apply_lora, merged_weights
from services.trainer.parallel.pipeline import last_stage_head, stage_logprobs
from services.trainer.nvtx import phase
from services.trainer.model.optim import apply_hyperparams
from services.trainer.parallel.mesh import (CommandChannel, ParallelDims, gather_to_rank0, init_distributed,
                                            launched_world_size, local_device)
from services.trainer.steps import StepRecord
from services.trainer.model.trained import Trained, ValueModel, build_trained
from services.trainer.types import (ActorLoss, CriticLoss, CriticSample, DPOLoss, OptimSettings, PreferencePair,
                                    RunOptim, RunStep, TrainSample)
from services.trainer.updates.actor import ActorUpdate
from services.trainer.updates.critic import CriticUpdate, response_values
from services.trainer.updates.dpo import DPOUpdate
from services.trainer.updates.runner import Update, run_update

log = logging.getLogger("meshrl.trainer")

# Commands that are one profiling phase as a whole; training commands mark forward_backward and optimizer inside.
COMMAND_PHASES = {"compute_logprobs": "logprobs", "compute_values": "values", "state_for_sync": "state_for_sync",
                  "export_hf": "export_hf", "save_checkpoint": "save_checkpoint", "load_checkpoint": "load_checkpoint"}


def _with_optim(cfg, optim: OptimSettings, section: str):
    """`cfg` (the trainer's actor or critic section) with a run's optimizer settings, validated; errors name the
    key (`actor.lr: ...`)."""
    try:
        return type(cfg)(**{**cfg.model_dump(), **asdict(optim)})
    except ValidationError as e:
        raise ValueError(format_validation_error(e, source="", section=section)) from None


def _optim_of(trained: Trained) -> OptimSettings:
    """The settings in effect, read back from the optimizer (AdamW's) and the section the schedule follows."""
    group, cfg = trained.optimizer.param_groups[0], trained.cfg
    return OptimSettings(lr=trained.scheduler.base_lrs[0], weight_decay=group["weight_decay"],
                         betas=tuple(group["betas"]), eps=group["eps"], grad_clip=cfg.grad_clip,
                         lr_schedule=cfg.lr_schedule, warmup_steps=cfg.warmup_steps, total_steps=cfg.total_steps,
                         min_lr_ratio=cfg.min_lr_ratio)


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
            key = "actor.model_path" if a.model_path else "model.path"  # the key the user set
            raise ValueError(f"{key}: {self.model_path!r} is not a Hugging Face model folder (no config.json)")
        self.param_dtype, self.compute_dtype = master_and_compute_dtypes(a, m.dtype)
        set_threads(m.num_threads)
        self.device = local_device(m.device)
        init_distributed(self.device.type)
        self.rank = dist.get_rank()
        module = self._load_actor()
        self.resolved = Resolved("trainer", log, emit=self.rank == 0)
        packed = self._setup_packing(module, a.use_remove_padding)
        self.layout = RankLayout(
            self.dims, self.device, pad_id=self.pad_id, compute_dtype=self.compute_dtype,
            # FSDP/DDP already mix in the compute dtype; autocast covers the unsharded case.
            autocast=self.compute_dtype != self.param_dtype and not (a.dp_mode == "fsdp" and self.dims.dp > 1),
            num_microbatches=a.num_microbatches or self.dims.pp, schedule=a.pipeline_schedule, packed=packed)
        self.channel = CommandChannel()
        on_cuda = self.device.type == "cuda"
        compile_blocks = self.compiled = bool(self.resolved.pick(
            "actor.compile", a.compile, on_cuda, "CUDA device" if on_cuda else f"device {self.device.type}"))
        # Before parallelize: the check reads plain parameters, and the forward it installs is the one
        # FSDP's and DDP's wrappers then call.
        self.fused_logprobs = self._setup_fused_head(module, a.fused_logprobs)
        self.actor = build_trained("actor", module, self.layout.mesh, a, a, self.param_dtype, self.compute_dtype,
                                   compile=compile_blocks)
        self.layout.tie(module, self.hf_config.tie_word_embeddings)
        # The last optimizer step of each update checks its gradient norm after the fact, with the call's stats
        # (fused AdamW only; see trained.optimizer_step); False checks before stepping, as every other step.
        self.defer_last_step = True
        self.critic: Trained | None = None
        if settings.critic is not None:
            self.critic = build_trained("critic", self._load_value_model(settings.critic), self.layout.mesh,
                                        settings.critic, a, self.param_dtype, self.compute_dtype,
                                        compile=compile_blocks)
        self.weight_version = 0
        self.warmup_seconds = 0.0
        # Gathers each pipeline stage's weights to its sender for weight sync and export (built on first use).
        self._gatherer: StageGatherer | None = None
        self.steps = StepRecord()
        self.critic_steps = StepRecord("critic")
        self._lock = threading.Lock()
        self._closed = False
        devices = gather_to_rank0(str(self.device), self.channel.group)
        self.devices = ",".join(devices) if devices else str(self.device)
        for trained in self._models():
            log.info("Rank %d: %s loaded on %s (%s)", self.rank, trained.name, self.device, self.dims.describe())

    def _load_actor(self) -> nn.Module:
        """The initial policy, as Hugging Face loads it (seeded first: nothing random may differ across ranks)."""
        torch.manual_seed(self.cfg.seed)
        lora = self.cfg.lora
        # Under LoRA the frozen base stays in model.dtype; only the adapters hold master weights.
        dtype = self.settings.model.dtype if lora else self.param_dtype
        module = load_causal_lm(self.model_path, dtype=dtype, device=str(self.device), trainable=True)
        # No dropout in RL updates: at the first step of a batch the ratio to the old policy must be exactly 1.
        module.train(False)
        self.hf_config = copy.deepcopy(module.config)
        if lora:
            check_lora_targets(self.model_path, lora)
            apply_lora(module, lora, adapter_dtype=DTYPES[self.param_dtype])
        self.hf_config.architectures = [type(module).__name__]
        # What ExportHF writes: the model's dtype (or weight_sync_dtype), not the fp32 master weights'.
        self.hf_config.dtype = self.cfg.weight_sync_dtype or self.settings.model.dtype
        self.pad_id = module.config.pad_token_id or 0
        self.vocab_size = module.config.vocab_size
        self.max_len = getattr(module.config, "max_position_embeddings", None)
        return module

    def _setup_fused_head(self, module: nn.Module, wanted: bool | None) -> bool:
        """Turns the fused head on where it applies (null: wherever it can; true on a head it cannot fuse is
        refused by enable_fused_head). Pipeline stages compute their log-probs from the last stage's hidden
        states in chunks whatever this says (services/trainer/parallel/pipeline.py). Under TP the head is vocab-parallel
        (services/common/vocab_parallel.py)."""
        if self.dims.pp > 1:
            return self.resolved.pick("actor.fused_logprobs", wanted if wanted is not True else False, False,
                                      "pipeline stages compute log-probs in chunks on the last stage")
        reason = supports_fused_head(module)
        if not self.resolved.pick("actor.fused_logprobs", wanted, reason is None,
                                  "the LM head can be fused" if reason is None else reason):
            return False
        enable_fused_head(module)
        return True

    def _setup_packing(self, module: nn.Module, wanted: bool | None) -> bool:
        """Packed rows (remove padding). Null: on for half-precision compute on CUDA wherever the model and mesh
        allow (the varlen kernel; measured faster than padded rows on one H200, bench/results/trainer_packing.json),
        off elsewhere; true under PP or on a model whose attention cannot be confined to each sequence is refused
        by name."""
        if self.dims.pp > 1 and wanted is True:
            raise ValueError("actor.use_remove_padding: pipeline stages run right-padded rows "
                             "(actor.pp_size > 1); leave it auto or set it false")
        why_not = ("actor.pp_size > 1: pipeline stages run right-padded rows" if self.dims.pp > 1
                   else f"device {self.device.type}" if self.device.type != "cuda"
                   else f"compute dtype {self.compute_dtype}" if self.compute_dtype not in ("bfloat16", "float16")
                   else supports_packing(module))
        if not self.resolved.pick("actor.use_remove_padding", wanted, why_not is None,
                                  "half-precision compute on CUDA" if why_not is None else why_not):
            return False
        enable_packing(module, "actor.use_remove_padding")
        return True

    def _load_value_model(self, cfg: CriticConfig) -> ValueModel:
        from transformers import AutoModel

        path = cfg.model_path or self.model_path
        backbone = AutoModel.from_pretrained(path, dtype=DTYPES[self.param_dtype], local_files_only=True)
        if self.layout.packed:
            enable_packing(backbone, "actor.use_remove_padding")
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
            return self.COMMANDS[name](self, *args)

    def warm_up(self) -> float:
        """With compile, builds the actor's compiled graphs before the trainer serves (seconds taken; every rank).

        One forward + backward and one no-grad forward at two shapes (services/common/compile.py WARMUP_SHAPES),
        through the training step's own log-prob call; the gradients are dropped. Weights, optimizer state, step
        count and weight version are untouched. Skipped under pipeline parallel (its schedule compiles at the
        first step)."""
        if not (self.compiled and self.cfg.warmup) or self.dims.pp > 1:
            return 0.0
        t0 = time.perf_counter()
        self._run("warm_up")
        self.warmup_seconds = time.perf_counter() - t0
        if self.rank == 0:
            log.info("trainer: warm-up (compile) took %.1f s", self.warmup_seconds)
        return self.warmup_seconds

    def compute_logprobs(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                         temperature: float = 1.0) -> list[list[float]]:
        self._check_sequences(prompts, responses)
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature: must be > 0, got {temperature}")
        return self._run("compute_logprobs", [list(p) for p in prompts], [list(r) for r in responses], temperature)

    def compute_reference_logprobs(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                                   temperature: float = 1.0) -> list[list[float]]:
        """Log-probs of the reference policy: the base model with the LoRA adapters off (actor.lora only)."""
        if self.cfg.lora is None:
            raise FailedPrecondition("reference log-probs from the trainer need actor.lora (the base model is the "
                                     "reference only while adapters train); use a reference service")
        self._check_sequences(prompts, responses)
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature: must be > 0, got {temperature}")
        return self._run("compute_logprobs", [list(p) for p in prompts], [list(r) for r in responses], temperature,
                         True)

    def compute_values(self, prompts, responses) -> list[list[float]]:
        self._require_critic()
        self._check_sequences(prompts, responses)
        return self._run("compute_values", [list(p) for p in prompts], [list(r) for r in responses])

    def train_actor(self, samples: Sequence[TrainSample], loss: ActorLoss,
                    run_step: RunStep | None = None) -> dict[str, float]:
        """One policy update (ppo_epochs over mini-batches); bumps the weight version."""
        return self.train_actor_step(samples, loss, run_step)[0]

    def train_actor_step(self, samples: Sequence[TrainSample], loss: ActorLoss,
                         run_step: RunStep | None) -> tuple[dict[str, float], bool]:
        """train_actor recorded as `run_step` (services/trainer/steps.py): -> (metrics, repeated)."""
        self._check_batch_size("samples", len(samples))
        validate_actor_batch(samples, loss, vocab_size=self.vocab_size, max_len=self.max_len, dp_size=self.dims.dp)
        return self.steps.apply(run_step, lambda: self._run("train_actor", list(samples), loss),
                                lambda: self.weight_version)

    def train_dpo(self, pairs: Sequence[PreferencePair], loss: DPOLoss,
                  run_step: RunStep | None = None) -> dict[str, float]:
        """One preference update (DPO / IPO / cDPO) over mini-batches of pairs; bumps the weight version."""
        return self.train_dpo_step(pairs, loss, run_step)[0]

    def train_dpo_step(self, pairs: Sequence[PreferencePair], loss: DPOLoss,
                       run_step: RunStep | None) -> tuple[dict[str, float], bool]:
        """train_dpo recorded as `run_step`: -> (metrics, repeated)."""
        self._check_batch_size("pairs", len(pairs))
        validate_dpo_batch(pairs, loss, vocab_size=self.vocab_size, max_len=self.max_len, dp_size=self.dims.dp)
        return self.steps.apply(run_step, lambda: self._run("train_dpo", list(pairs), loss),
                                lambda: self.weight_version)

    def train_critic(self, samples: Sequence[CriticSample], loss: CriticLoss,
                     run_step: RunStep | None = None) -> dict[str, float]:
        return self.train_critic_step(samples, loss, run_step)[0]

    def train_critic_step(self, samples: Sequence[CriticSample], loss: CriticLoss,
                          run_step: RunStep | None) -> tuple[dict[str, float], bool]:
        """train_critic recorded as `run_step` in the critic's own record: -> (metrics, repeated)."""
        self._require_critic()
        self._check_batch_size("samples", len(samples))
        validate_critic_batch(samples, loss, vocab_size=self.vocab_size, max_len=self.max_len, dp_size=self.dims.dp)
        return self.critic_steps.apply(run_step, lambda: self._run("train_critic", list(samples), loss),
                                       lambda: self.weight_version)

    def state_for_sync(self, on_device: bool = False) -> tuple[dict[str, torch.Tensor], int]:
        """Full copies of the actor's weights (HF names, no tied duplicates) and their version: on CPU, or on
        rank 0's device for the device transports (ipc, nccl)."""
        if on_device and self.device.type != "cuda":
            raise FailedPrecondition(f"weight_sync.transport: ipc and nccl need the trainer on a CUDA device, "
                                     f"it runs on {self.device}")
        return self._run("state_for_sync", on_device), self.weight_version

    def save_checkpoint(self, path: str) -> dict:
        checkpoint.check_target(path, "save checkpoint")
        # Held so no update lands between the save and the run step it reports.
        with self.steps.hold():
            self._run("save_checkpoint", path, self.weight_version)
            return self._checkpoint_result(path)

    def load_checkpoint(self, path: str, run_step: RunStep | None = None) -> dict:
        # Every file against the manifest before any rank reads one: a damaged checkpoint is refused by name.
        meta = checkpoint.verify(path)
        if bool(meta.get("has_critic")) != (self.critic is not None):
            raise FailedPrecondition(f"path: checkpoint {'has' if meta.get('has_critic') else 'has no'} critic, "
                                     f"this trainer {'has' if self.critic else 'has none'}")
        with self.steps.hold():
            self._run("load_checkpoint", path)
            # The weights are now the checkpoint's: the record of the last applied step is the caller's word for
            # which run step they are, or nothing.
            self.steps.restored(run_step)
            self.critic_steps.restored(run_step)
            return self._checkpoint_result(path)

    def export_hf(self, path: str) -> dict:
        checkpoint.check_target(path, "export to")
        with checkpoint.file_errors(f"export to {path!r}"):
            self._run("export_hf", path)
        return self._checkpoint_result(path)

    def configure_run(self, run: RunOptim) -> RunOptim:
        """Sets a run's optimizer hyperparameters on every rank; answers with the values now in effect."""
        if (run.critic is None) != (self.critic is None):
            raise FailedPrecondition("critic: this trainer has " + ("a critic; the run must give its optimizer "
                                     "settings" if self.critic else "no critic (set when the trainer starts)"))
        actor = _with_optim(self.cfg, run.actor, "actor")
        critic = _with_optim(self.critic.cfg, run.critic, "critic") if self.critic else None
        self._run("configure_run", actor, critic, run.reset_schedule)
        return RunOptim(_optim_of(self.actor), _optim_of(self.critic) if self.critic else None,
                        reset_schedule=run.reset_schedule, actor_lr=self.actor.optimizer.param_groups[0]["lr"])

    def bubble_fraction(self) -> float:
        """Idle share of the actor's pipeline step (0 without PP)."""
        return self.layout.bubble_fraction(len(self.actor.stages))

    def info(self) -> dict:
        return {"tp": self.dims.tp, "pp": self.dims.pp, "dp": self.dims.dp, "world_size": self.dims.world_size,
                "devices": self.devices, "step": self.actor.step, "dtype": self.compute_dtype,
                "param_dtype": self.param_dtype, "dp_mode": self.cfg.dp_mode,
                "pipeline_schedule": self.cfg.pipeline_schedule, "num_microbatches": self.layout.num_microbatches,
                "pp_stages_per_rank": len(self.actor.stages),
                "critic": self.critic is not None, "critic_step": self.critic.step if self.critic else 0,
                "micro_batch_token_budget": self.cfg.micro_batch_token_budget, "max_model_len": self.max_len,
                "activation_checkpointing": self.cfg.activation_checkpointing,
                "fused_logprobs": self.fused_logprobs, "use_remove_padding": self.layout.packed,
                "lora_rank": self.cfg.lora.rank if self.cfg.lora else 0,
                "compile": self.compiled, "warmup_seconds": round(self.warmup_seconds, 3),
                **self.steps.details()}

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
            except BaseException as e:  # noqa: BLE001 - rank 0 validated the input; keep serving and say why
                if passes_through(e):
                    raise
                log.exception("Rank %d: command %s failed", self.rank, name)

    def _require_critic(self) -> None:
        if self.critic is None:
            raise FailedPrecondition("no critic configured (add a `critic:` section to the trainer config)")

    def _check_batch_size(self, field: str, n: int) -> None:
        if n > self.cfg.max_batch_size:
            raise ValueError(f"{field}: {n} exceed actor.max_batch_size={self.cfg.max_batch_size}")

    def _check_sequences(self, prompts, responses) -> None:
        validate_sequences(prompts, responses, vocab_size=self.vocab_size, max_len=self.max_len)
        self._check_batch_size("sequences", len(prompts))

    def _checkpoint_result(self, path: str) -> dict:
        return {"path": path, "step": self.actor.step, "weight_version": self.weight_version,
                "run_step": self.steps.last}

    # ---- per-rank work ----------------------------------------------------------------------------

    def _update(self, update: Update) -> dict[str, float]:
        return run_update(update, seed=self.cfg.seed if self.cfg.shuffle else None,
                          defer_last_step=self.defer_last_step)

    def _local_train_actor(self, samples: list[TrainSample], loss: ActorLoss) -> dict[str, float]:
        metrics = self._update(ActorUpdate(self.layout, self.actor, samples, loss, fused=self.fused_logprobs))
        self.weight_version += 1
        return metrics

    def _local_train_dpo(self, pairs: list[PreferencePair], loss: DPOLoss) -> dict[str, float]:
        metrics = self._update(DPOUpdate(self.layout, self.actor, pairs, loss, fused=self.fused_logprobs))
        self.weight_version += 1
        return metrics

    def _local_configure_run(self, actor, critic, reset_schedule: bool) -> None:
        self.cfg = actor
        for trained, cfg in ((self.actor, actor), (self.critic, critic)):
            if trained is not None:
                trained.cfg = cfg
                apply_hyperparams(trained.optimizer, trained.scheduler, cfg, reset_schedule=reset_schedule)

    def _local_train_critic(self, samples: list[CriticSample], loss: CriticLoss) -> dict[str, float]:
        return self._update(CriticUpdate(self.layout, self.critic, samples, loss))

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

    def _local_warm_up(self) -> None:
        def forward_backward(prompts, responses):
            with self.layout.amp():
                logp, mask, entropy = sequence_logprobs(self.actor.forward, prompts, responses, pad_id=self.pad_id,
                                                        device=self.device, packed=self.layout.packed,
                                                        fused=self.fused_logprobs)
            ((logp * mask).sum() + (entropy * mask).sum()).backward()

        for trained in self._models():
            trained.optimizer.zero_grad(set_to_none=True)
        warm_up_forward(forward_backward, vocab_size=self.vocab_size, device=self.device, max_len=self.max_len)
        for trained in self._models():
            trained.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            warm_up_forward(lambda ps, rs: self._actor_logprobs(ps, rs, 1.0), vocab_size=self.vocab_size,
                            device=self.device, max_len=self.max_len)

    @torch.no_grad()
    def _local_compute_logprobs(self, prompts, responses, temperature: float, base: bool = False):
        """The actor's log-probs; base=True: the LoRA base model's (adapters off for the call)."""
        with adapters_off(self.actor.module) if base else nullcontext():
            return self._actor_logprobs(prompts, responses, temperature)

    def _actor_logprobs(self, prompts, responses, temperature: float):
        # Same packing and forward as services.common.modeling.batched_logprobs, so a one-rank trainer
        # and the reference service agree bit for bit on the same weights.
        if self.dims.pp > 1:
            return self._merge_on_rank0(self._pp_logprobs(prompts, responses, temperature), len(prompts))
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
        out: dict[int, list[float]] = {}
        for group in self.layout.local_groups(range(len(prompts)), lengths, self.cfg.micro_batch_token_budget):
            ps, rs = self._group_ids(group, prompts, responses)
            with self.layout.amp():
                logp = sequence_logprobs(self.actor.forward, ps, rs, pad_id=self.pad_id, device=self.device,
                                         temperature=temperature, packed=self.layout.packed,
                                         fused=self.fused_logprobs)[0]
            logp = logp.cpu()
            for row, i in enumerate(group or []):
                out[i] = logp[row, :len(responses[i])].tolist()
        return self._merge_on_rank0(out, len(prompts))

    @torch.no_grad()
    def _pp_logprobs(self, prompts, responses, temperature: float) -> dict[int, list[float]]:
        rows = self.layout.pp_rows(list(range(len(prompts))))
        pad = [self.pad_id]
        input_ids, positions, mask, targets = self.layout.pp_inputs(
            [prompts[i] if i is not None else pad for i in rows],
            [responses[i] if i is not None else pad for i in rows], [i is not None for i in rows])
        hidden = self.layout.run_pipeline(self.actor.stages, input_ids)
        out: dict[int, list[float]] = {}
        if self.layout.is_last_stage:
            head = last_stage_head(self.actor.stages)
            if hasattr(head, "placements") and head.device_mesh.mesh_dim_names != ("tp",):
                head = head.full_tensor()          # FSDP resharded the head after the schedule: one gather, no grad
            with self.layout.amp():
                logp, _ = stage_logprobs(hidden, head, positions, targets, mask, temperature)
            for row, i in enumerate(rows):
                if i is not None:
                    out[i] = logp[row, :len(responses[i])].cpu().tolist()
        return out

    @torch.no_grad()
    def _local_compute_values(self, prompts, responses):
        lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
        out: dict[int, list[float]] = {}
        for group in self.layout.local_groups(range(len(prompts)), lengths, self.critic.cfg.micro_batch_token_budget):
            ps, rs = self._group_ids(group, prompts, responses)
            values, _ = response_values(self.layout, self.critic.forward, ps, rs)
            values = values.cpu()
            for row, i in enumerate(group or []):
                out[i] = values[row, :len(responses[i])].tolist()
        return self._merge_on_rank0(out, len(prompts))

    @torch.no_grad()
    def _full_weights(self, on_device: bool = False) -> dict[str, torch.Tensor] | None:
        """Every actor weight, full and on CPU (on_device: on rank 0's device), on rank 0 (None elsewhere):
        HF names, tied weights once.

        Each pipeline stage's TP/FSDP shards are gathered to the stage's sender (its rank at dp = tp = 0) in
        buckets of weight_sync.device_bucket_bytes, one gather per bucket (services/trainer/weights/gather.py); the
        stages' senders then send their part to rank 0.
        """
        # Replicas and exported folders hold the model's dtype, whatever the master weights' dtype.
        dtype = DTYPES[self.cfg.weight_sync_dtype or self.settings.model.dtype]
        # Pipeline stages meet on rank 0 through a CPU gather, so only a one-stage mesh stays on the device.
        where = self.device if on_device and self.dims.pp == 1 else "cpu"
        # Under LoRA: the base weights with the adapters merged in, under the model's own names.
        weights = merged_weights(self.actor.module) if self.cfg.lora else named_weights(self.actor.module)
        if self.dims.world_size == 1:
            return {name: t.detach().to(where, dtype=dtype, copy=True) for name, t in weights.items()}
        if self._gatherer is None:
            self._gatherer = stage_gatherers(self.layout.mesh)
        mine = self._gatherer.gather(weights, dtype=dtype, where=where,
                                     bucket_bytes=self.settings.weight_sync.device_bucket_bytes)
        sender = self.rank != 0 and mine is not None
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

    # The commands rank 0 broadcasts and every rank runs (`_run(name, *args)`): the ranks' channel carries the
    # name, and this table is the one place a name maps to code.
    COMMANDS = {"warm_up": _local_warm_up, "compute_logprobs": _local_compute_logprobs,
                "compute_values": _local_compute_values, "train_actor": _local_train_actor,
                "train_dpo": _local_train_dpo, "train_critic": _local_train_critic,
                "state_for_sync": _local_state_for_sync, "save_checkpoint": _local_save_checkpoint,
                "load_checkpoint": _local_load_checkpoint, "export_hf": _local_export_hf,
                "configure_run": _local_configure_run}
