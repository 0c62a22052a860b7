"""One trainer rank: its place on the mesh, the models it trains and their weight version, built once at start-up.

Every rank builds the same `Rank` from the same settings; the commands rank 0 sends (services/trainer/commands.py)
then run on it. The build checks the mesh before anything heavy, then loads the actor, resolves the `auto` switches
that depend on it, lays it out on the mesh (services/trainer/parallel/) and gives it its optimizer
(services/trainer/model/), and the critic after it: the same order on every rank, as the collectives need.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch.distributed as dist

from services.common.auto import Resolved
from services.common.tensors.modeling import set_threads
from services.trainer.config import ActorConfig, TrainerSettings, master_and_compute_dtypes
from services.trainer.model import fresh
from services.trainer.model.load import load_actor, load_value_model, setup_fused_head, setup_packing
from services.trainer.model.trained import Trained, build_trained
from services.trainer.parallel.layout import RankLayout
from services.trainer.parallel.mesh import (ParallelDims, gather_to_rank0, init_distributed, launched_world_size,
                                            local_device, object_group)
from services.trainer.weights.gather import StageGatherer

log = logging.getLogger("meshrl.trainer")


class Rank:
    """What one rank holds: its settings and mesh, the actor (and critic) with their optimizers, the weight version."""

    def __init__(self, settings: TrainerSettings):
        a, m = settings.actor, settings.model
        if settings.critic is not None and a.pp_size > 1:
            raise ValueError("critic: a critic with actor.pp_size > 1 is not implemented yet")
        # The mesh is checked before anything heavy happens, so a bad launch fails in a second.
        self.dims = ParallelDims(dp=a.dp_size, pp=a.pp_size, tp=a.tp_size, world_size=launched_world_size())
        self.settings = settings
        self.model_path = a.model_path or m.path
        if not (Path(self.model_path) / "config.json").is_file():
            key = "actor.model_path" if a.model_path else "model.path"  # the key the user set
            raise ValueError(f"{key}: {self.model_path!r} is not a Hugging Face model folder (no config.json)")
        self.param_dtype, self.compute_dtype = master_and_compute_dtypes(a, m.dtype)
        set_threads(m.num_threads)
        self.device = local_device(m.device)
        init_distributed(self.device.type)
        self.index = dist.get_rank()
        module, self.hf_config = load_actor(settings, self.model_path, param_dtype=self.param_dtype, device=self.device)
        self.pad_id = module.config.pad_token_id or 0
        self.vocab_size = module.config.vocab_size
        self.max_len = getattr(module.config, "max_position_embeddings", None)
        self.resolved = Resolved("trainer", log, emit=self.index == 0)
        packed = setup_packing(module, a.use_remove_padding, resolved=self.resolved, pp=self.dims.pp,
                               device=self.device, compute_dtype=self.compute_dtype)
        self.layout = RankLayout(
            self.dims, self.device, pad_id=self.pad_id, compute_dtype=self.compute_dtype,
            # FSDP/DDP already mix in the compute dtype; autocast covers the unsharded case.
            autocast=self.compute_dtype != self.param_dtype and not (a.dp_mode == "fsdp" and self.dims.dp > 1),
            num_microbatches=a.num_microbatches or self.dims.pp, schedule=a.pipeline_schedule, packed=packed)
        # Rank 0's commands and what the ranks gather back to it (services/trainer/commands.py).
        self.group = object_group()
        on_cuda = self.device.type == "cuda"
        self.compiled = bool(self.resolved.pick("actor.compile", a.compile, on_cuda,
                                                "CUDA device" if on_cuda else f"device {self.device.type}"))
        # Before parallelize: the check reads plain parameters, and the forward it installs is the one FSDP's and
        # DDP's wrappers then call.
        self.fused_logprobs = setup_fused_head(module, a.fused_logprobs, resolved=self.resolved, pp=self.dims.pp)
        self.actor = self._build("actor", module, a)
        self.layout.tie(module, self.hf_config.tie_word_embeddings)
        # The last optimizer step of each update checks its gradient norm after the fact, with the call's stats
        # (fused AdamW only; see model/trained.optimizer_step); False checks before stepping, as every other step.
        self.defer_last_step = True
        self.critic: Trained | None = None
        if settings.critic is not None:
            value_model = load_value_model(settings.critic.model_path or self.model_path, param_dtype=self.param_dtype,
                                           device=self.device, packed=packed)
            self.critic = self._build("critic", value_model, settings.critic)
        self.weight_version = 0
        # What a run that starts from the model path starts from (services/trainer/model/fresh.py), and whether
        # the models hold exactly that, untouched (no update, no checkpoint load since the start or a reset).
        self.initial = {t.name: self._initial(t) for t in self.models()}
        self.pristine = True
        # Gathers each pipeline stage's weights to its sender for weight sync and export (built on first use).
        self.gatherer: StageGatherer | None = None
        devices = gather_to_rank0(str(self.device), self.group)
        self.devices = ",".join(devices) if devices else str(self.device)
        for trained in self.models():
            log.info("Rank %d: %s loaded on %s (%s)", self.index, trained.name, self.device, self.dims.describe())

    def _build(self, name: str, module, cfg) -> Trained:
        a = self.settings.actor
        return build_trained(name, module, self.layout.mesh, cfg, a, self.param_dtype, self.compute_dtype,
                             compile=self.compiled)

    def _initial(self, trained: Trained) -> fresh.Initial:
        if trained.name == "actor":
            # Under LoRA only the adapters train: they are kept, the frozen base never changes.
            folder = None if self.settings.actor.lora else self.model_path
            return fresh.keep_initial(trained, folder, fresh.actor_state, folder_holds=lambda name: True)
        folder = self.settings.critic.model_path or self.model_path
        return fresh.keep_initial(trained, folder, fresh.critic_state,
                                  folder_holds=lambda name: not name.startswith("value_head."))

    @property
    def cfg(self) -> ActorConfig:
        """The `actor:` section in effect: the trainer's, with the run's optimizer settings (ConfigureRun)."""
        return self.actor.cfg

    def models(self) -> list[Trained]:
        """The models this rank trains: the actor, then the critic when there is one."""
        return [self.actor] + ([self.critic] if self.critic else [])
