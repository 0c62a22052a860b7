"""The training API's engine: the training clients open on the mesh's trainer, and the bookkeeping their
primitives need. Under LoRA each client trains its own adapter over the one frozen base (the trainer's named
adapters, CreateAdapter), several at once; a full-parameter client holds the trainer alone. ForwardBackward and
OptimStep run on the trainer on the client's adapter (its commands accumulate gradients and step); Sample first
brings the rollout replicas to the client's current adapter (the trainer's PushWeights of it alone) when it changed
since that client's last sample, then samples under it; SaveState / LoadState are its adapter's saved state. Calls
run one at a time, in the order they arrive (Tinker's ordering guarantee). No gRPC here: the calls go through
`backends.Mesh`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from services.common.errors import FailedPrecondition, NotFound
from services.training_api.config import TrainingSettings
from services.training_api.types import ClientInfo, SampleResponse, StateInfo

log = logging.getLogger("meshrl.training_api")
# The tokenizer files GetTokenizer sends (what AutoTokenizer reads from a model folder).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "chat_template.jinja", "added_tokens.json")


def _serial(fn):
    """Runs the call under the engine's lock, one at a time in arrival order, and to its end once begun: a caller
    that goes away (deadline, cancel, a killed process) leaves it finishing on the trainer, so the lock is held
    until the trainer is done and the next call cannot start (or check its state) before that."""
    @functools.wraps(fn)
    async def call(self, *args, **kwargs):
        async with self._lock:
            task = asyncio.ensure_future(fn(self, *args, **kwargs))
            try:
                return await asyncio.shield(task)
            except asyncio.CancelledError:
                await asyncio.wait([task])
                raise
    return call


@dataclass
class OpenClient:
    info: ClientInfo
    # The weight version the rollout replicas hold for this client (None: unknown, pushed before a sample).
    synced: int | None = None
    # When it last made a call (monotonic seconds).
    last_call: float = field(default_factory=time.monotonic)


class TrainingEngine:
    def __init__(self, settings: TrainingSettings, mesh):
        self.settings = settings
        self.mesh = mesh
        self.clients: dict[str, OpenClient] = {}
        # The version the last push put on the replicas (GetInfo's synced_version).
        self.synced: int | None = None
        # The adapter each replica serves the last pushed client under ("" = merged in: its engine serves no
        # adapters), and the client whose merged weights those replicas hold: one client at a time samples there.
        self.serves: dict[str, str] = {}
        self.merged_owner: str | None = None
        self._lock = asyncio.Lock()
        self._tokenizer = None
        self.model_path = ""

    # ---- clients ----------------------------------------------------------------------------------

    @_serial
    async def create(self, base_model: str, rank: int) -> ClientInfo:
        """A training client on the trainer's model: under LoRA its own fresh adapter beside the open clients'
        (CreateAdapter on the trainer), else the trainer's weights, alone (refused while any client is open)."""
        await self._release_idle()
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
        if not held and self.clients:
            raise FailedPrecondition(f"training client {next(iter(self.clients))} is open on this trainer; a "
                                     f"full-parameter client trains the trainer's weights alone (close it first)")
        client_id = uuid.uuid4().hex[:12]
        if held:
            adapter = self._free_adapter_name()
            created = await self.mesh.create_adapter(adapter)
            version = created.weight_version
        else:
            adapter, version = "", (await self.mesh.start_fresh()).weight_version
        self.model_path = info.model
        client = ClientInfo(client_id, info.model, rank, version, 0, adapter)
        self.clients[client_id] = OpenClient(client)
        log.info("training API: client %s opened on %s (%s)", client_id, info.model,
                 f"LoRA rank {rank}, adapter {adapter!r}" if held else "every weight")
        return client

    def _free_adapter_name(self) -> str:
        """The lowest `client-<k>` no open client uses. Reused after a client closes: a rollout replica keeps an
        adapter's slot (rollout.max_loras) until it is replaced, so reuse bounds the slots to the clients open at
        once; a reused name is pushed again before its first Sample."""
        taken = {c.info.adapter for c in self.clients.values()}
        return next(f"client-{k}" for k in range(len(taken) + 1) if f"client-{k}" not in taken)

    @_serial
    async def close_client(self, client_id: str) -> ClientInfo:
        client = self._check(client_id)
        await self._drop(client_id)
        log.info("training API: client %s closed", client_id)
        return client

    async def _drop(self, client_id: str) -> None:
        """Forgets the client and deletes its adapter on the trainer (its weights and optimizer state)."""
        client = self.clients.pop(client_id).info
        if self.merged_owner == client_id:
            self.merged_owner = None
        if client.adapter:
            await self.mesh.delete_adapter(client.adapter)

    def _check(self, client_id: str) -> ClientInfo:
        open_client = self.clients.get(client_id)
        if open_client is None:
            raise NotFound(f"client_id: no open training client {client_id!r}"
                           + (f" (open: {', '.join(self.clients)})" if self.clients else ""))
        open_client.last_call = time.monotonic()
        return open_client.info

    async def _release_idle(self) -> None:
        """Closes clients idle past training_api.release_idle_s (a script that died without close())."""
        limit = self.settings.training_api.release_idle_s
        now = time.monotonic()
        for client_id, c in list(self.clients.items()):
            if limit and now - c.last_call > limit:
                log.warning("training API: client %s made no call for %.0f s (training_api.release_idle_s=%g): "
                            "closed", client_id, now - c.last_call, limit)
                await self._drop(client_id)

    # ---- primitives -------------------------------------------------------------------------------

    @_serial
    async def forward_backward(self, client_id: str, request):
        """`request`: the trainer's ForwardBackwardRequest as it came (the trainer checks it), on the client's
        adapter."""
        client = self._check(client_id)
        return await self.mesh.forward_backward(request, client.adapter)

    @_serial
    async def optim_step(self, client_id: str, adam):
        client = self._check(client_id)
        response = await self.mesh.optim_step(adam, client.adapter)
        client.weight_version, client.step = response.weight_version, response.step
        return response

    @_serial
    async def sample(self, client_id: str, prompts: list[list[int]], sampling) -> tuple[list[SampleResponse], int]:
        """n samples of each prompt from the client's current weights (its adapter, pushed alone when it changed
        since its last sample); -> (one response per prompt, version)."""
        client = self._check(client_id)
        if await self.mesh.refresh_rollout():
            # Replicas came or went: none is known to hold any client's weights; each sample pushes first.
            self.serves, self.merged_owner = {}, None
            for other in self.clients.values():
                other.synced = None
        if not self.mesh.rollout_addresses:
            raise FailedPrecondition("rollout.servers: this mesh has no rollout replica to sample on (a recipe "
                                     "with rollout.replicas >= 1, or rollout.dns naming them)")
        if not prompts or any(not p for p in prompts):
            raise ValueError("prompts: at least one prompt, each with at least one token")
        open_client = self.clients[client_id]
        # Only a LoRA client's merged push can displace another's (a full-parameter client holds the trainer alone).
        merged = sorted(t for t, name in self.serves.items() if not name) if client.adapter else []
        if merged and self.merged_owner not in (None, client_id):
            raise FailedPrecondition(
                f"sample: rollout replica {', '.join(merged)} serves no LoRA adapters and holds training client "
                f"{self.merged_owner}'s weights merged; one client at a time samples there (close that client, "
                f"or serve adapters: a torch replica with rollout.enable_lora)")
        if open_client.synced != client.weight_version or (merged and self.merged_owner != client_id):
            version, serves = await self.mesh.push_weights(client.adapter)
            self.synced = open_client.synced = client.weight_version = version
            self.serves.update(serves)
            if client.adapter and any(not name for name in serves.values()):
                self.merged_owner = client_id
        return await self.mesh.generate(prompts, sampling, self.serves), client.weight_version

    @_serial
    async def save_state(self, client_id: str, name: str) -> StateInfo:
        client = self._check(client_id)
        if not name:
            raise ValueError("path: a name (under training_api.state_dir) or an absolute path")
        path = name if os.path.isabs(name) else str(Path(self.settings.training_api.state_dir, name).resolve())
        saved = await self.mesh.save(path, client.adapter)
        return StateInfo(saved.path, saved.step, saved.weight_version)

    @_serial
    async def load_state(self, client_id: str, path: str) -> StateInfo:
        client = self._check(client_id)
        if not path:
            raise ValueError("path: the path SaveState answered")
        loaded = await self.mesh.load(path, client.adapter)
        client.weight_version, client.step = loaded.weight_version, loaded.step
        # The replicas may hold a version of that number from before the save: push whatever they hold.
        self.clients[client_id].synced = None
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
                "clients": ",".join(self.clients),
                "synced_version": "" if self.synced is None else str(self.synced)}      # "": no push yet

    async def close(self) -> None:
        """The service stops: its channels close (an open client's trainer state stays where it is)."""
        await self.mesh.close()


def _same_model(asked: str, held: str) -> bool:
    """The same folder (a relative path resolves against this service's directory), or the same name."""
    if asked == held:
        return True
    return os.path.exists(asked) and os.path.exists(held) and os.path.samefile(asked, held)
