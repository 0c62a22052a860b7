"""The training API's engine: one training client at a time on the mesh's trainer, and the bookkeeping its
primitives need. ForwardBackward and OptimStep run on the trainer (its commands accumulate gradients and step);
Sample first brings the rollout replicas to the client's current weights (the trainer's PushWeights) when they
changed since the last sample; SaveState / LoadState are the trainer's checkpoints. Calls run one at a time, in
the order they arrive (Tinker's ordering guarantee). No gRPC here: the calls go through `backends.Mesh`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from pathlib import Path

from services.common.errors import FailedPrecondition, NotFound
from services.training_api.config import TrainingSettings
from services.training_api.types import ClientInfo, SampleResponse, StateInfo

log = logging.getLogger("meshrl.training_api")
# The tokenizer files GetTokenizer sends (what AutoTokenizer reads from a model folder).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "chat_template.jinja", "added_tokens.json")


class TrainingEngine:
    def __init__(self, settings: TrainingSettings, mesh):
        self.settings = settings
        self.mesh = mesh
        self.client: ClientInfo | None = None
        # The weight version the rollout replicas hold for this client (None: unknown, pushed before a sample).
        self.synced: int | None = None
        self._lock = asyncio.Lock()
        self._tokenizer = None
        self.model_path = ""
        # When the open client last made a call (monotonic seconds).
        self.last_call = 0.0

    # ---- clients ----------------------------------------------------------------------------------

    async def create(self, base_model: str, rank: int) -> ClientInfo:
        """A training client on the trainer's model with fresh adapters of `rank`; refused while one is open."""
        async with self._lock:
            self._release_idle()
            if self.client is not None:
                raise FailedPrecondition(f"training client {self.client.client_id} is open on this trainer; one "
                                         f"client at a time (close it first)")
            info = await self.mesh.trainer_info()
            held = int(info.details.get("lora_rank", "0") or 0)
            if not _same_model(base_model, info.model):
                raise FailedPrecondition(f"base_model: this mesh's trainer holds {info.model!r}, not {base_model!r}")
            if info.details.get("critic") == "True":
                raise FailedPrecondition("critic: the training API trains the actor alone; this trainer has a critic "
                                         "(start the mesh from a recipe without a `critic:` section)")
            if rank != held:
                raise FailedPrecondition(f"rank: this mesh's trainer trains " + (
                    f"LoRA rank {held} (actor.lora.rank, set at its start)" if held else
                    "every weight (no actor.lora; rank 0)") + f", not rank {rank}")
            started = await self.mesh.start_fresh()
            self.model_path, self.synced = info.model, None
            self.client = ClientInfo(uuid.uuid4().hex[:12], info.model, rank, started.weight_version, 0)
            self.last_call = time.monotonic()
            log.info("training API: client %s opened on %s (rank %d)", self.client.client_id, info.model, rank)
            return self.client

    async def close_client(self, client_id: str) -> ClientInfo:
        async with self._lock:
            client = self._check(client_id)
            self.client = None
            log.info("training API: client %s closed", client_id)
            return client

    def _check(self, client_id: str) -> ClientInfo:
        if self.client is None or self.client.client_id != client_id:
            raise NotFound(f"client_id: no open training client {client_id!r}"
                           + (f" (the open one is {self.client.client_id})" if self.client else ""))
        self.last_call = time.monotonic()
        return self.client

    def _release_idle(self) -> None:
        """Closes an open client idle past training_api.release_idle_s (a script that died without close())."""
        limit = self.settings.training_api.release_idle_s
        idle = time.monotonic() - self.last_call
        if self.client is not None and limit and idle > limit:
            log.warning("training API: client %s made no call for %.0f s (training_api.release_idle_s=%g): closed "
                        "for the next client", self.client.client_id, idle, limit)
            self.client = None

    # ---- primitives -------------------------------------------------------------------------------

    async def forward_backward(self, client_id: str, request):
        """`request`: the trainer's ForwardBackwardRequest as it came (the trainer checks it)."""
        async with self._lock:
            self._check(client_id)
            return await self.mesh.forward_backward(request)

    async def optim_step(self, client_id: str, adam):
        async with self._lock:
            client = self._check(client_id)
            response = await self.mesh.optim_step(adam)
            client.weight_version, client.step = response.weight_version, response.step
            return response

    async def sample(self, client_id: str, prompts: list[list[int]], sampling) -> tuple[list[SampleResponse], int]:
        """n samples of each prompt from the client's current weights; -> (one response per prompt, version)."""
        async with self._lock:
            client = self._check(client_id)
            if not self.mesh.rollout_addresses:
                raise FailedPrecondition("rollout.servers: this mesh has no rollout replica to sample on (a recipe "
                                         "with rollout.replicas >= 1)")
            if not prompts or any(not p for p in prompts):
                raise ValueError("prompts: at least one prompt, each with at least one token")
            if self.synced != client.weight_version:
                self.synced = await self.mesh.push_weights()
                client.weight_version = self.synced
            return await self.mesh.generate(prompts, sampling), client.weight_version

    async def save_state(self, client_id: str, name: str) -> StateInfo:
        async with self._lock:
            self._check(client_id)
            if not name:
                raise ValueError("path: a name (under training_api.state_dir) or an absolute path")
            path = name if os.path.isabs(name) else str(Path(self.settings.training_api.state_dir, name).resolve())
            saved = await self.mesh.save(path)
            return StateInfo(saved.path, saved.step, saved.weight_version)

    async def load_state(self, client_id: str, path: str) -> StateInfo:
        async with self._lock:
            client = self._check(client_id)
            if not path:
                raise ValueError("path: the path SaveState answered")
            loaded = await self.mesh.load(path)
            client.weight_version, client.step = loaded.weight_version, loaded.step
            # The replicas may hold a version of that number from before the save: push whatever they hold.
            self.synced = None
            return StateInfo(loaded.path, loaded.step, loaded.weight_version)

    # ---- the tokenizer ----------------------------------------------------------------------------

    def tokenizer(self, client_id: str):
        """The base model's tokenizer (loaded once, from the trainer's model path)."""
        self._check(client_id)
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            except OSError as e:
                raise FailedPrecondition(f"tokenizer: cannot load the trainer's model path {self.model_path!r} "
                                         f"here ({e})") from None
        return self._tokenizer

    def tokenizer_files(self, client_id: str) -> dict[str, bytes]:
        self.tokenizer(client_id)
        folder = Path(self.model_path)
        return {name: (folder / name).read_bytes() for name in TOKENIZER_FILES if (folder / name).is_file()}

    def info(self) -> dict:
        return {"trainer": self.mesh.trainer_address, "rollout": ",".join(self.mesh.rollout_addresses),
                "client": self.client.client_id if self.client else "", "synced_version": self.synced}

    async def close(self) -> None:
        """The service stops: its channels close (an open client's trainer state stays where it is)."""
        await self.mesh.close()


def _same_model(asked: str, held: str) -> bool:
    """The same folder (a relative path resolves against this service's directory), or the same name."""
    if asked == held:
        return True
    return os.path.exists(asked) and os.path.exists(held) and os.path.samefile(asked, held)
