"""Every service as a real gRPC server on port 0 inside one process: for tests and notebooks.

`meshrl up` runs each service as its own process instead; the code path per service is the same
(`services.<role>.servicer.start`).
"""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass, field
from typing import Any

from services.common.config import deep_merge, load_config
from services.common.roles import PACKAGES, SERVICE_ROLES, settings_class


@dataclass
class LocalMesh:
    """Started servers and engines by role, and the run config data with their addresses filled in."""

    config: dict
    servers: dict[str, list[Any]] = field(default_factory=dict)
    engines: dict[str, list[Any]] = field(default_factory=dict)
    addresses: dict[str, list[str]] = field(default_factory=dict)

    async def stop(self) -> None:
        for role in list(self.servers):
            for server, engine in zip(self.servers[role], self.engines[role]):
                await server.stop(0)
                closer = getattr(engine, "close", None)
                if closer is not None:
                    result = closer()
                    if hasattr(result, "__await__"):
                        await result


# Each role's settings class and the servicer module whose `start(settings, address)` serves it, imported
# when that role first starts (a test that starts one reward service loads no trainer).
ROLES: dict[str, tuple[str, str]] = {role: (settings_class(role), f"{PACKAGES[role]}.servicer")
                                     for role in SERVICE_ROLES}


async def start_role(role: str, data: dict):
    if role not in ROLES:
        raise ValueError(f"role: unknown role {role!r}")
    settings_path, servicer = ROLES[role]
    module, _, name = settings_path.partition(":")
    settings = load_config(getattr(importlib.import_module(module), name), data=data)
    return await importlib.import_module(servicer).start(settings, "127.0.0.1:0")


async def start_local_mesh(config: dict, *, num_rollout: int = 2, num_reward: int = 1, num_reference: int = 1,
                           num_env: int = 0) -> LocalMesh:
    """Starts trainer, reference, reward, env and rollout replicas; returns their addresses in `config`. Env
    replicas start before the rollout replicas, whose episode loops call them (`env.servers`)."""
    data = copy.deepcopy(config)
    mesh = LocalMesh(data)
    counts = {"trainer": 1, "reference": num_reference, "reward": num_reward, "env": num_env, "rollout": num_rollout}
    for role, count in ((role, counts[role]) for role in SERVICE_ROLES):
        if role == "rollout" and mesh.addresses.get("env"):
            data["env"] = deep_merge(data.get("env") or {}, {"servers": mesh.addresses["env"]})
        for _ in range(count):
            server, port, engine = await start_role(role, data)
            mesh.servers.setdefault(role, []).append(server)
            mesh.engines.setdefault(role, []).append(engine)
            mesh.addresses.setdefault(role, []).append(f"127.0.0.1:{port}")
    for role in ("rollout", "reward", "reference"):
        data[role] = deep_merge(data.get(role) or {}, {"servers": mesh.addresses.get(role, [])})
    data["trainer"] = deep_merge(data.get("trainer") or {}, {"address": mesh.addresses["trainer"][0]})
    return mesh
