"""The mesh's roles, written once: the services, and the package that runs each role as a process
(`python -m <package>`). The CLI's `meshrl serve`, `meshrl up`'s launcher and the in-process test mesh all read it."""

from __future__ import annotations

# In the order a mesh starts them (env replicas before the rollout replicas whose episode loops call them).
SERVICE_ROLES = ("trainer", "reference", "reward", "env", "rollout")
# Beside the coordinator: the training API (docs/training_api.md), a client of the trainer and the rollout replicas
# that `meshrl mesh` serves for users' own loops.
API_ROLES = ("training",)
PACKAGES: dict[str, str] = {"coordinator": "coordinator", **{role: f"services.{role}" for role in SERVICE_ROLES},
                            "training": "services.training_api"}


def settings_class(role: str) -> str:
    """`module:Class` of a service role's settings (services.trainer.config:TrainerSettings)."""
    return f"services.{role}.config:{role.capitalize()}Settings"
