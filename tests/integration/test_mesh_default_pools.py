"""A run whose recipe lists no servers runs on the mesh's replicas: the coordinator's own sections (what `meshrl up`
and `meshrl mesh` start), else the replicas registered in Redis; a role the mesh lacks is refused by name, with the
command that starts one."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from coordinator.runapi.default_pools import DefaultPools
from coordinator.runapi.runs import RunManager, parse_run_config
from coordinator.runapi.store import MemoryStore
from services.common.config import PoolConfig
from services.common.rpc.registry import Registry

ARITH = (open("examples/arith/grpo.yaml").read())


def test_a_role_the_recipe_leaves_empty_takes_the_mesh_servers_and_its_rejoin_wait():
    defaults = DefaultPools({"rollout": PoolConfig(servers=["127.0.0.1:7001"], rejoin_wait_s=60.0),
                             "reward": PoolConfig(servers=["127.0.0.1:7002"])}, trainer_address="127.0.0.1:7000")
    cfg = parse_run_config("reward: {servers: ['10.0.0.1:1']}\n")
    filled = asyncio.run(defaults.fill(asyncio.run(defaults.fill_trainer(cfg)), ["rollout", "reward"]))
    assert filled.rollout.servers == ["127.0.0.1:7001"] and filled.rollout.rejoin_wait_s == 60.0
    assert filled.reward.servers == ["10.0.0.1:1"]           # the recipe's own list wins
    assert filled.trainer.address == "127.0.0.1:7000"
    assert filled.rollout.n == cfg.rollout.n                  # nothing else of the recipe moves


def test_start_run_names_the_role_the_mesh_lacks_and_how_to_start_one():
    # A mesh with no reference replica, and the arithmetic recipe's KL loss needs one.
    defaults = DefaultPools({"rollout": PoolConfig(servers=["127.0.0.1:7001"]),
                             "reward": PoolConfig(servers=["127.0.0.1:7002"])}, trainer_address="127.0.0.1:7000")
    manager = RunManager(MemoryStore(), defaults=defaults)
    with pytest.raises(ValueError) as err:
        asyncio.run(manager.start_run(ARITH))
    line = str(err.value)
    assert line.startswith("reference.servers: the recipe lists no reference replica and this coordinator knows none")
    assert "meshrl mesh RECIPE" in line and "meshrl serve reference" in line


def test_a_recipe_without_a_trainer_on_a_coordinator_without_one_is_refused_by_its_key():
    manager = RunManager(MemoryStore(), defaults=DefaultPools({}))
    with pytest.raises(ValueError, match=r"^trainer\.address: the recipe names no trainer and this coordinator "
                                         r"knows none .*meshrl serve trainer"):
        asyncio.run(manager.start_run(ARITH))


def test_with_a_registry_the_registered_replicas_fill_the_run():
    registered = {"trainer": "127.0.0.1:7100", "rollout": "127.0.0.1:7101", "reward": "127.0.0.1:7102"}

    async def go():
        registry = Registry("redis://127.0.0.1:6379", prefix=f"test-mesh-{uuid.uuid4().hex[:8]}")
        for role, address in registered.items():
            await registry.register(role, address)
        defaults = DefaultPools({role: PoolConfig() for role in ("rollout", "reward", "reference")},
                                registry=registry)
        cfg = await defaults.fill_trainer(parse_run_config(ARITH))
        filled = await defaults.fill(cfg, ["rollout", "reward"])
        with pytest.raises(ValueError) as err:
            await defaults.fill(cfg, ["rollout", "reward", "reference"])
        listed = {p.role: await p.discover() for p in defaults.pools}
        await defaults.close()
        for role, address in registered.items():
            await registry.deregister(role, address)
        await registry.close()
        return cfg, filled, str(err.value), listed

    cfg, filled, missing, listed = asyncio.run(go())
    assert cfg.trainer.address == "127.0.0.1:7100"
    assert filled.rollout.registry and filled.reward.registry and not filled.rollout.servers
    assert missing.startswith("reference.servers: the recipe lists no reference replica and none is registered "
                              "with this mesh")
    # `meshrl services` (ListServices, no run id) shows the registered replicas as the mesh's pools.
    assert listed == {"rollout": ["127.0.0.1:7101"], "reward": ["127.0.0.1:7102"], "reference": []}
