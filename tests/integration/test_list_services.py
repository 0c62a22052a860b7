"""ListServices: a run's replicas by run id, NOT_FOUND for an unknown one, the coordinator's own pools for none."""

import asyncio
from types import SimpleNamespace

import pytest

from coordinator.runapi.default_pools import DefaultPools
from coordinator.runapi.runs import RunManager
from coordinator.runapi.service import CoordinatorServicer
from coordinator.runapi.store import MemoryStore, RunRecord
from services.common.rpc.pools import Replica, ReplicaPool
from meshrl.v1 import coordinator_pb2
from services.common.config import PoolConfig
from services.common.errors import NotFound


def listing(servicer, run_id: str = "") -> list[tuple]:
    resp = asyncio.run(servicer.ListServices(coordinator_pb2.ListServicesRequest(run_id=run_id), None))
    return [(r.pool, r.address, r.healthy, r.weight_version, r.load) for r in resp.replicas]


@pytest.fixture
def servicer():
    """A coordinator whose own config names rollout replica 127.0.0.1:1, with an active run on another one and
    on 127.0.0.1:1 (which that run saw at weight version 7 with 2 calls in flight)."""
    manager = RunManager(MemoryStore())
    run_pool = ReplicaPool("rollout", stub_factory=lambda channel: None)
    run_pool.replicas = {a: Replica(a, channel=None, stub=None, weight_version=7, load=2)
                         for a in ("127.0.0.1:1", "127.0.0.1:2")}
    asyncio.run(manager.store.put(RunRecord(run_id="active", config="", state="RUNNING")))
    manager.contexts["active"] = SimpleNamespace(rollout=run_pool, reward=None, reference=None)
    return CoordinatorServicer(manager, DefaultPools({"rollout": PoolConfig(servers=["127.0.0.1:1"])}))


def test_an_empty_run_id_lists_the_coordinators_own_pools_even_with_a_run_active(servicer):
    # Health is checked at the call (nothing listens on port 1); load and version are what the run saw.
    assert listing(servicer) == [("rollout", "127.0.0.1:1", False, 7, 2)]


def test_a_run_id_lists_that_runs_replicas(servicer):
    assert listing(servicer, "active") == [("rollout", "127.0.0.1:1", True, 7, 2),
                                           ("rollout", "127.0.0.1:2", True, 7, 2)]


def test_an_unknown_run_id_is_not_found(servicer):
    with pytest.raises(NotFound) as err:  # the server's interceptor maps it to NOT_FOUND
        listing(servicer, "no-such-run")
    assert str(err.value) == "run_id: no run 'no-such-run'"


def test_a_replica_no_run_has_seen_has_no_weight_version_not_version_0():
    # 127.0.0.1:3 is one of the coordinator's own replicas that no active run has called: its version is unknown.
    servicer = CoordinatorServicer(RunManager(MemoryStore()),
                                   DefaultPools({"rollout": PoolConfig(servers=["127.0.0.1:3"])}))
    assert listing(servicer) == [("rollout", "127.0.0.1:3", False, -1, 0)]


def test_meshrl_services_shows_an_unknown_weight_version_as_a_dash():
    from typer.testing import CliRunner

    from coordinator.cli import app
    from tests.integration.stored_coordinator import StoredCoordinator

    with StoredCoordinator([], config={"rollout": {"servers": ["127.0.0.1:3"]}}) as address:
        result = CliRunner().invoke(app, ["services", "--coordinator", address])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[1].split() == ["rollout", "127.0.0.1:3", "no", "-", "0"]
