"""Settings of the training API service (docs/training_api.md): where the mesh's trainer and rollout replicas
listen (the recipe's `trainer.address` and `rollout.servers`, which `meshrl mesh` fills in) and its own
`training_api:` section. The face: no torch."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from services.common.config import MeshSettings, Section, ServerConfig


class _Reads(BaseModel):
    """A section of the recipe this service reads a few keys of; the rest belongs to other roles."""

    model_config = ConfigDict(extra="ignore")


class TrainerAddress(_Reads):
    """`trainer:` the trainer's rank 0, which runs ForwardBackward, OptimStep and the state calls."""

    address: str = ""


class RolloutServers(_Reads):
    """`rollout:` the replicas Sample generates on (the trainer pushes its weights to them): a list, or a DNS name
    that resolves to one address per replica (a compose service, a Kubernetes headless Service), re-resolved at
    every Sample so that replicas scaled in or out are pushed to and sampled on alike."""

    servers: list[str] = Field(default_factory=list)
    dns: str | None = None


class TrainingApiSection(Section):
    """`training_api:` the service's own keys."""

    # Where SaveState writes a state given by name (an absolute path is used as given).
    state_dir: str = "runs/training_api"
    # Deadline of one call to the trainer or a rollout replica (seconds).
    call_timeout_s: float = Field(600.0, gt=0)
    # An open client that made no call for this long is closed when another client asks for the trainer (its
    # script may have died without close()); 0 keeps it open until it closes.
    release_idle_s: float = Field(900.0, ge=0)


class TrainingSettings(MeshSettings):
    server: ServerConfig = ServerConfig()
    trainer: TrainerAddress = TrainerAddress()
    rollout: RolloutServers = RolloutServers()
    training_api: TrainingApiSection = TrainingApiSection()
