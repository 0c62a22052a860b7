"""Trainer engine: rank 0's API. No gRPC here.

Each public method checks its request (services/trainer/batch.py and this rank's limits), runs its command on
every rank (services/trainer/commands.py) and answers; ranks > 0 wait in `serve_workers`. What a rank holds,
its mesh and models, is its `Rank` (services/trainer/rank.py). One process is the world-size-1 case of the same
code.
"""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Sequence

import torch

from services.common.errors import FailedPrecondition
from services.common.tensors.modeling import validate_sequences
from services.trainer.batch import validate_actor_batch, validate_critic_batch, validate_dpo_batch
from services.trainer.coalesce import AdapterCoalescer, Coalescer, TrainMerger
from services.trainer.commands import Commands
from services.trainer.config import OptimSection, RunOptim, TrainerSettings
from services.trainer.model import adapter_set, adapters, checkpoint
from services.trainer.model.optim import settings_in_effect
from services.trainer.rank import Rank
from services.trainer.steps import StepRecord
from services.trainer.types import (ActorLoss, AdamParams, CriticLoss, CriticSample, Datum, DPOLoss, PreferencePair,
                                    PrimitiveLoss, RunStep, TrainSample)
from services.trainer.updates import merged
from services.trainer.updates.primitive import validate_datums
from services.trainer.weights import snapshots

log = logging.getLogger("meshrl.trainer")


class TrainerEngine:
    """The trainer on one rank. Public methods are called on rank 0 and run on every rank."""

    def __init__(self, settings: TrainerSettings):
        self.rank = Rank(settings)
        self.commands = Commands(self.rank)
        # The run steps the updates applied (services/trainer/steps.py), kept by rank 0.
        self.steps = StepRecord()
        self.critic_steps = StepRecord("critic")
        self.warmup_seconds = 0.0
        # ForwardBackward calls whose gradients wait for an OptimStep (the training API).
        self.pending_gradients = 0
        # Concurrent log-prob calls of one model and temperature share a command (several runs' reference calls
        # on one LoRA trainer), up to the request-size limit (services/trainer/coalesce.py).
        limit = self.rank.cfg.max_batch_size
        self.reference = Coalescer(self.commands, "compute_logprobs", True, max_rows=limit)
        self.actor_logprobs = AdapterCoalescer(self.commands, max_rows=limit)
        # Concurrent TrainActor calls of different adapters (several runs' updates) share one pass.
        self.train_merger = TrainMerger(self.commands, wait_passes=self.rank.cfg.merge_wait_passes)

    # ---- log-probs and values ---------------------------------------------------------------------

    def warm_up(self) -> float:
        """With compile, builds the actor's compiled graphs before the trainer serves (seconds taken; every rank).

        One forward + backward and one no-grad forward at two shapes (services/common/tensors/compile.py WARMUP_SHAPES),
        through the training step's own log-prob call; the gradients are dropped. Weights, optimizer state, step
        count and weight version are untouched. Skipped under pipeline parallel (its schedule compiles at the
        first step)."""
        r = self.rank
        if not (r.compiled and r.cfg.warmup) or r.dims.pp > 1:
            return 0.0
        t0 = time.perf_counter()
        self.commands.run("warm_up")
        self.warmup_seconds = time.perf_counter() - t0
        if r.index == 0:
            log.info("trainer: warm-up (compile) took %.1f s", self.warmup_seconds)
        return self.warmup_seconds

    def compute_logprobs(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                         temperature: float = 1.0, adapter: str = "") -> list[list[float]]:
        """The actor's log-probs, or named adapter `adapter`'s."""
        self._check_sequences(prompts, responses, temperature)
        if adapter:
            adapter_set.get(self.rank, adapter)
        # Concurrent calls of one temperature share a command, several adapters' rows in one forward where this
        # trainer runs them so (coalesce.AdapterCoalescer).
        return self.actor_logprobs.adapter_logprobs(prompts, responses, temperature, adapter,
                                                    mixes=merged.mixes(self.rank))

    def compute_reference_logprobs(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                                   temperature: float = 1.0) -> list[list[float]]:
        """Log-probs of the reference policy: the base model with the LoRA adapters off (actor.lora only).
        Concurrent calls (several runs' on one trainer) of one temperature share a command (coalesce.py)."""
        if self.rank.cfg.lora is None:
            raise FailedPrecondition("reference log-probs from the trainer need actor.lora (the base model is the "
                                     "reference only while adapters train); use a reference service")
        self._check_sequences(prompts, responses, temperature)
        return self.reference.logprobs(prompts, responses, temperature)

    def compute_values(self, prompts, responses) -> list[list[float]]:
        self._require_critic()
        self._check_sequences(prompts, responses)
        return self.commands.run("compute_values", [list(p) for p in prompts], [list(r) for r in responses])

    # ---- updates ----------------------------------------------------------------------------------

    def train_actor(self, samples: Sequence[TrainSample], loss: ActorLoss,
                    run_step: RunStep | None = None) -> dict[str, float]:
        """One policy update (ppo_epochs over mini-batches); bumps the weight version."""
        return self.train_actor_step(samples, loss, run_step)[0]

    def train_actor_step(self, samples: Sequence[TrainSample], loss: ActorLoss,
                         run_step: RunStep | None, adapter: str = "") -> tuple[dict[str, float], bool]:
        """train_actor recorded as `run_step` (services/trainer/steps.py): -> (metrics, repeated). A named
        `adapter`'s update (a concurrent run's) is applied to it alone and not recorded: the record is the run's."""
        r = self.rank
        self._check_batch_size("samples", len(samples))
        validate_actor_batch(samples, loss, vocab_size=r.vocab_size, max_len=r.max_len, dp_size=r.dims.dp)
        key = merged.merge_key(r, samples, loss)
        if adapter:
            adapter_set.get(r, adapter)
            return self.train_merger.train(list(samples), loss, adapter, key), False
        return self.steps.apply(run_step, lambda: self.train_merger.train(list(samples), loss, "", key),
                                lambda: r.weight_version)

    def train_dpo(self, pairs: Sequence[PreferencePair], loss: DPOLoss,
                  run_step: RunStep | None = None) -> dict[str, float]:
        """One preference update (DPO / IPO / cDPO) over mini-batches of pairs; bumps the weight version."""
        return self.train_dpo_step(pairs, loss, run_step)[0]

    def train_dpo_step(self, pairs: Sequence[PreferencePair], loss: DPOLoss,
                       run_step: RunStep | None) -> tuple[dict[str, float], bool]:
        """train_dpo recorded as `run_step`: -> (metrics, repeated)."""
        r = self.rank
        self._check_batch_size("pairs", len(pairs))
        validate_dpo_batch(pairs, loss, vocab_size=r.vocab_size, max_len=r.max_len, dp_size=r.dims.dp)
        return self.steps.apply(run_step, lambda: self.commands.run("train_dpo", list(pairs), loss),
                                lambda: r.weight_version)

    def train_critic(self, samples: Sequence[CriticSample], loss: CriticLoss,
                     run_step: RunStep | None = None) -> dict[str, float]:
        return self.train_critic_step(samples, loss, run_step)[0]

    def train_critic_step(self, samples: Sequence[CriticSample], loss: CriticLoss,
                          run_step: RunStep | None) -> tuple[dict[str, float], bool]:
        """train_critic recorded as `run_step` in the critic's own record: -> (metrics, repeated)."""
        r = self.rank
        self._require_critic()
        self._check_batch_size("samples", len(samples))
        validate_critic_batch(samples, loss, vocab_size=r.vocab_size, max_len=r.max_len, dp_size=r.dims.dp)
        return self.critic_steps.apply(run_step, lambda: self.commands.run("train_critic", list(samples), loss),
                                       lambda: r.weight_version)

    def configure_run(self, run: RunOptim) -> RunOptim:
        """Sets a run's optimizer hyperparameters on every rank, after its starting weights when it starts
        (`run.start`); answers with the values now in effect and where the weights came from."""
        r = self.rank
        if run.adapter:
            return self._configure_adapter(run)
        if (run.critic is None) != (r.critic is None):
            raise FailedPrecondition("critic: this trainer has " + ("a critic; the run must give its optimizer "
                                     "settings" if r.critic else "no critic (set when the trainer starts)"))
        # Checked here, before any rank changes: a bad value is refused by its key and nothing is half-applied.
        actor = r.actor.cfg.with_run(run.actor, "actor")
        critic = r.critic.cfg.with_run(run.critic, "critic") if r.critic else None
        started = self._start(run.start.checkpoint) if run.start is not None else ""
        self.commands.run("configure_run", actor, critic, run.reset_schedule or run.start is not None)
        applied = [settings_in_effect(t.optimizer, t.scheduler, t.cfg) for t in r.models()]
        return RunOptim(applied[0], applied[1] if r.critic else None, reset_schedule=run.reset_schedule,
                        actor_lr=r.actor.optimizer.param_groups[0]["lr"], started_from=started,
                        weight_version=r.weight_version)

    def _configure_adapter(self, run: RunOptim) -> RunOptim:
        """A concurrent run's optimizer settings on its named adapter (which starts as the base at CreateAdapter)."""
        if run.start is not None:
            raise FailedPrecondition(f"start: adapter {run.adapter!r} starts as the base when CreateAdapter makes "
                                     f"it; a named adapter's run starts from no other weights")
        if run.critic is not None:
            raise FailedPrecondition(f"critic: adapter {run.adapter!r} trains the actor alone (no critic)")
        named = adapter_set.get(self.rank, run.adapter)
        actor = named.trained.cfg.with_run(run.actor, "actor")
        self.commands.run("configure_adapter", run.adapter, actor, run.reset_schedule)
        t = named.trained
        return RunOptim(settings_in_effect(t.optimizer, t.scheduler, t.cfg), None, reset_schedule=run.reset_schedule,
                        actor_lr=t.optimizer.param_groups[0]["lr"], weight_version=named.weight_version,
                        adapter=run.adapter)

    def _start(self, checkpoint_path: str) -> str:
        """A run starts: the weights from the checkpoint, or the model path's (not reloaded when the trainer holds
        exactly those, untouched); optimizer state cleared. -> where they came from, in words."""
        r = self.rank
        if checkpoint_path:
            self._check_checkpoint(checkpoint_path)
            command, args = "start_from_checkpoint", (checkpoint_path,)
            said = f"checkpoint {checkpoint_path} (weights loaded, optimizer state cleared)"
        elif r.pristine:
            return f"model.path {r.model_path} (the trainer's start-up weights, untouched: not reloaded)"
        else:
            command, args = "start_from_model", ()
            said = f"model.path {r.model_path} (weights reloaded, optimizer state cleared)"
        with self.steps.hold():
            self.commands.run(command, *args)
            self.pending_gradients = 0          # the start cleared them with the optimizer state
            # No run step made these weights.
            self.steps.restored(None)
            self.critic_steps.restored(None)
        log.info("trainer: a run starts from %s, as weight version %d", said, r.weight_version)
        return said

    # ---- the training API's primitives (docs/training_api.md) ------------------------------------------

    def forward_backward(self, data: Sequence[Datum], loss: PrimitiveLoss,
                         adapter: str = "") -> tuple[dict[str, float], list[list[float]]]:
        """Adds the batch's gradient (summed loss) to the actor's, or to named adapter `adapter`'s alone; the
        weights stay. -> (metrics, each Datum's log-probs of its targets)."""
        r = self.rank
        if r.dims.pp > 1:
            raise FailedPrecondition("forward_backward: the training API runs without pipeline parallel (pp_size 1)")
        if adapter:
            adapter_set.get(r, adapter)
        self._check_batch_size("data", len(data))
        validate_datums(list(data), loss, vocab_size=r.vocab_size, max_len=r.max_len)
        out = self.commands.run("forward_backward", list(data), loss, adapter)
        self.pending_gradients += not adapter
        return out

    def optim_step(self, adam: AdamParams, adapter: str = "") -> dict[str, float]:
        """One AdamW step with `adam` over the gradients of the ForwardBackward calls since the last step (of
        named adapter `adapter` alone when given)."""
        if not (adapter_set.get(self.rank, adapter).pending if adapter else self.pending_gradients):
            raise FailedPrecondition("optim_step: no gradients to apply (call forward_backward first)")
        try:
            actor = self.rank.cfg.with_run(_as_section(adam), "adam_params")
        except ValueError as e:             # the message in AdamParams' names, not the run section's
            raise ValueError(str(e).replace("adam_params.lr", "adam_params.learning_rate").replace(
                "adam_params.betas", "adam_params.beta1/beta2").replace("adam_params.grad_clip",
                                                                        "adam_params.grad_clip_norm")) from None
        metrics = self.commands.run("optim_step", actor, adapter)
        if not adapter:
            self.pending_gradients = 0
        return metrics

    # ---- named adapters beside the run's (services/trainer/model/adapter_set.py) -------------------------

    def create_adapter(self, name: str) -> adapter_set.NamedAdapter:
        adapter_set.check_new(self.rank, name)
        self.commands.run("create_adapter", name)
        return adapter_set.get(self.rank, name)

    def delete_adapter(self, name: str) -> None:
        adapter_set.get(self.rank, name)
        self.commands.run("delete_adapter", name)
        self.train_merger.forget(name)

    def adapter_names(self) -> list[str]:
        return sorted(adapter_set.named(self.rank))

    def adapter_version(self, adapter: str = "") -> int:
        return adapter_set.get(self.rank, adapter).weight_version if adapter else self.rank.weight_version

    def adapter_progress(self, adapter: str = "") -> tuple[int, int]:
        """(optimizer steps, weight version) of the actor, or of a named adapter."""
        if not adapter:
            return self.rank.actor.step, self.rank.weight_version
        named = adapter_set.get(self.rank, adapter)
        return named.trained.step, named.weight_version

    # ---- weights out: sync, checkpoints, export -----------------------------------------------------

    def state_for_sync(self, on_device: bool = False, kind: str = "full",
                       adapter: str = "") -> tuple[dict[str, torch.Tensor], int]:
        """Full copies of the actor's weights (HF names, no tied duplicates) and their version: on CPU, or on
        rank 0's device for the device transports (ipc, nccl). kind (under actor.lora): "full" merged, "base" the
        frozen base alone, "adapter" the adapter alone (services/trainer/weights/full.py SYNC_KINDS). An adapter
        whose last change stored its push is sent from that, without a command (weights/snapshots.py)."""
        if on_device and self.rank.device.type != "cuda":
            raise FailedPrecondition(f"weight_sync.transport: ipc and nccl need the trainer on a CUDA device, "
                                     f"it runs on {self.rank.device}")
        if kind == "adapter":
            if adapter:
                adapter_set.get(self.rank, adapter)
            held = snapshots.held(self.rank, adapter, on_device)
            if held is not None:
                return held
        if adapter and kind != "base":          # a named adapter (alone or merged), under its own version
            return self.commands.run("adapter_for_sync", adapter, on_device, kind)
        return self.commands.run("state_for_sync", on_device, kind)

    def save_checkpoint(self, path: str, adapter: str = "") -> dict:
        checkpoint.check_target(path, "save checkpoint")
        if adapter:
            named = adapter_set.get(self.rank, adapter)
            with checkpoint.file_errors(f"save checkpoint to {path!r}"):
                self.commands.run("save_adapter", adapter, path, adapters.base_identity(self.rank.model_path))
            return {"path": path, "step": named.trained.step, "weight_version": named.weight_version,
                    "run_step": None}
        # Held so no update lands between the save and the run step it reports.
        with self.steps.hold():
            self.commands.run("save_checkpoint", path, self.rank.weight_version)
            return self._checkpoint_result(path)

    def load_checkpoint(self, path: str, run_step: RunStep | None = None, adapter: str = "") -> dict:
        if adapter:
            named = adapter_set.get(self.rank, adapter)
            state = adapter_set.read(path, base=adapters.base_identity(self.rank.model_path), lora=self.rank.cfg.lora)
            self.commands.run("load_adapter", adapter, state)
            return {"path": path, "step": named.trained.step, "weight_version": named.weight_version,
                    "run_step": None}
        self._check_checkpoint(path)
        with self.steps.hold():
            self.commands.run("load_checkpoint", path)
            self.pending_gradients = 0          # the load dropped them
            # The weights are now the checkpoint's: the record of the last applied step is the caller's word for
            # which run step they are, or nothing.
            self.steps.restored(run_step)
            self.critic_steps.restored(run_step)
            return self._checkpoint_result(path)

    def export_hf(self, path: str, merged: bool = False) -> dict:
        """The actor as a Hugging Face folder; under actor.lora its adapters as a peft folder (adapter_config.json +
        adapter_model.safetensors) unless `merged` asks for the base with the adapters merged in."""
        checkpoint.check_target(path, "export to")
        with checkpoint.file_errors(f"export to {path!r}"):
            self.commands.run("export_adapter" if self.rank.cfg.lora and not merged else "export_hf", path)
        return self._checkpoint_result(path)

    # ---- state ------------------------------------------------------------------------------------

    def bubble_fraction(self) -> float:
        """Idle share of the actor's pipeline step (0 without PP)."""
        return self.rank.layout.bubble_fraction(len(self.rank.actor.stages))

    def info(self) -> dict:
        r, cfg = self.rank, self.rank.cfg
        return {"tp": r.dims.tp, "pp": r.dims.pp, "dp": r.dims.dp, "world_size": r.dims.world_size,
                "devices": r.devices, "step": r.actor.step, "dtype": r.compute_dtype, "param_dtype": r.param_dtype,
                "dp_mode": cfg.dp_mode, "pipeline_schedule": cfg.pipeline_schedule,
                "num_microbatches": r.layout.num_microbatches, "pp_stages_per_rank": len(r.actor.stages),
                "critic": r.critic is not None, "critic_step": r.critic.step if r.critic else 0,
                "micro_batch_token_budget": cfg.micro_batch_token_budget, "max_model_len": r.max_len,
                "activation_checkpointing": cfg.activation_checkpointing,
                "fused_logprobs": r.fused_logprobs, "use_remove_padding": r.layout.packed,
                "lora_rank": cfg.lora.rank if cfg.lora else 0, "named_adapters": ",".join(self.adapter_names()),
                "compile": r.compiled, "warmup_seconds": round(self.warmup_seconds, 3),
                **self.reference.info("reference"), **self.actor_logprobs.info("logprobs"),
                **self.train_merger.info("train"),
                **self.steps.details(), "run_step_metrics": self._run_step_metrics()}

    def _run_step_metrics(self) -> str:
        """The last applied run step's metrics as JSON (services/trainer/steps.py), with the critic's update of the
        same step when it has one; "" when none are kept."""
        applied = self.steps.applied()
        if not applied:
            return ""
        critic = self.critic_steps.metrics_of(self.steps.last)
        if critic is not None:
            applied["critic"] = critic
        return json.dumps(applied)

    def close(self) -> None:
        """Releases ranks > 0 from their loop; the engine takes no commands afterwards."""
        self.commands.close()

    def serve_workers(self) -> None:
        """The loop of ranks > 0: run each command rank 0 broadcasts until it says shutdown."""
        self.commands.serve()

    # ---- request checks (rank 0, before any rank runs) ---------------------------------------------

    def _require_critic(self) -> None:
        if self.rank.critic is None:
            raise FailedPrecondition("no critic configured (add a `critic:` section to the trainer config)")

    def _check_batch_size(self, field: str, n: int) -> None:
        if n > self.rank.cfg.max_batch_size:
            raise ValueError(f"{field}: {n} exceed actor.max_batch_size={self.rank.cfg.max_batch_size}")

    def _check_sequences(self, prompts, responses, temperature: float = 1.0) -> None:
        validate_sequences(prompts, responses, vocab_size=self.rank.vocab_size, max_len=self.rank.max_len)
        self._check_batch_size("sequences", len(prompts))
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature: must be > 0, got {temperature}")

    def _check_checkpoint(self, path: str) -> None:
        """Every file against the manifest before any rank reads one: a damaged checkpoint is refused by name."""
        meta = checkpoint.verify(path)
        adapters.check_checkpoint_base(meta, path, model_path=self.rank.model_path, lora=self.rank.cfg.lora is not None)
        critic = self.rank.critic
        if bool(meta.get("has_critic")) != (critic is not None):
            raise FailedPrecondition(f"path: checkpoint {'has' if meta.get('has_critic') else 'has no'} critic, "
                                     f"this trainer {'has' if critic else 'has none'}")

    def _checkpoint_result(self, path: str) -> dict:
        return {"path": path, "step": self.rank.actor.step, "weight_version": self.rank.weight_version,
                "run_step": self.steps.last}


def _as_section(adam: AdamParams) -> OptimSection:
    """One OptimStep's AdamParams as a run's optimizer settings (unchecked: with_run checks them), at a constant lr."""
    return OptimSection.model_construct(lr=adam.learning_rate, weight_decay=adam.weight_decay,
                                        betas=(adam.beta1, adam.beta2), eps=adam.eps, grad_clip=adam.grad_clip_norm,
                                        lr_schedule="constant", warmup_steps=0, total_steps=0, min_lr_ratio=0.0)
