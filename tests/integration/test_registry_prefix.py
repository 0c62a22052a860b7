"""Two deployments on one Redis database keep apart: registry keys live under each one's `run.redis_prefix`."""

import uuid
from pathlib import Path

import pytest
import redis
import yaml

from coordinator.cli.launcher import Launcher
from coordinator.client import Client

pytestmark = pytest.mark.redis


def _deployment(tmp_path: Path, name: str, redis_url: str, prefix: str, *, by_flag: bool) -> Launcher:
    """A coordinator whose reward pool is the registry, and one reward replica that registers there. The prefix
    comes from the recipe's `run.redis_prefix`, or (by_flag) from `--run.redis_prefix` on every process."""
    run = {"redis_url": redis_url, **({} if by_flag else {"redis_prefix": prefix})}
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump({"server": {"registry_url": redis_url}, "run": run,
                                      "reward": {"registry": True}}))
    return Launcher(str(config), log_dir=tmp_path / name, overrides={"run.redis_prefix": prefix} if by_flag else {})


def test_two_deployments_sharing_a_redis_database_each_see_only_their_own_replicas(tmp_path, redis_url):
    prefixes = {name: f"meshrl-test-{name}-{uuid.uuid4().hex[:8]}" for name in ("a", "b")}
    launchers = {name: _deployment(tmp_path, name, redis_url, prefixes[name], by_flag=name == "b")
                 for name in prefixes}
    try:
        rewards = {name: la.start("reward") for name, la in launchers.items()}
        coordinators = {name: la.start("coordinator") for name, la in launchers.items()}
        addresses = {name: la.wait_ready(rewards[name]) for name, la in launchers.items()}
        for name, la in launchers.items():
            with Client(la.wait_ready(coordinators[name])) as client:
                seen = [(r.pool, r.address) for r in client.list_services()]
            assert seen == [("reward", addresses[name])], name
        keys = redis.Redis.from_url(redis_url, decode_responses=True)
        for name, prefix in prefixes.items():
            assert keys.zrange(f"{prefix}:services:reward", 0, -1) == [addresses[name]]
    finally:
        for la in launchers.values():
            la.stop_all()
    # A replica that stops leaves its own deployment's registry.
    assert all(keys.zrange(f"{p}:services:reward", 0, -1) == [] for p in prefixes.values())
