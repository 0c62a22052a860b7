"""The training API's `rollout.dns` (what compose and Kubernetes give it): one address per replica, re-resolved at every
Sample, and a changed replica set pushed to before it is sampled on (a replica that just joined holds no client's
weights)."""

from __future__ import annotations

import asyncio

import pytest

from services.common.rpc.pools import resolve_dns
from services.training_api import backends
from services.training_api.backends import Mesh, Upstream
from services.training_api.config import TrainingSettings
from services.training_api.engine import OpenClient, TrainingEngine
from services.training_api.types import ClientInfo, SampledSequence, SampleResponse


def test_the_dns_name_becomes_one_address_per_replica_and_a_refresh_tells_whether_it_changed():
    async def main():
        mesh = Mesh("127.0.0.1:1", [], token=None, timeout=5, rollout_dns="localhost:50051")
        try:
            first, again = await mesh.refresh_rollout(), await mesh.refresh_rollout()
            return first, again, list(mesh.rollout_addresses), len(mesh.rollout)
        finally:
            await mesh.close()

    first, again, addresses, stubs = asyncio.run(main())
    assert (first, again) == (True, False)
    assert addresses == resolve_dns("localhost:50051") and stubs == len(addresses)
    assert any(a.endswith(":50051") and "localhost" not in a for a in addresses)


def test_a_dns_name_that_does_not_resolve_fails_sample_by_name():
    async def main():
        mesh = Mesh("127.0.0.1:1", [], token=None, timeout=5, rollout_dns="no-such-replica.invalid:50051")
        try:
            await mesh.refresh_rollout()
        finally:
            await mesh.close()

    with pytest.raises(Upstream, match=r"rollout\.dns: 'no-such-replica\.invalid:50051' does not resolve") as e:
        asyncio.run(main())
    assert e.value.status == "UNAVAILABLE"


class RecordingMesh(Mesh):
    """The real Mesh (channels, DNS refresh) with the trainer's push and the replicas' Generate recorded."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pushed_to: list[list[str]] = []

    async def push_weights(self, adapter: str = ""):
        self.pushed_to.append(list(self.rollout_addresses))
        return 7, {a: adapter for a in self.rollout_addresses}

    async def generate(self, prompts, sampling, serves=None):
        assert set(serves or {}) >= set(self.rollout_addresses), "sampled on a replica no push reached"
        return [SampleResponse([SampledSequence([1], [0.0], "stop")]) for _ in prompts]


def test_sample_pushes_again_when_the_replica_set_changes_and_not_otherwise(monkeypatch):
    replicas = [["10.0.0.2:50051"]]
    monkeypatch.setattr(backends, "resolve_dns", lambda name: list(replicas[0]))

    async def main():
        mesh = RecordingMesh("127.0.0.1:1", [], token=None, timeout=5, rollout_dns="rollout:50051")
        engine = TrainingEngine(TrainingSettings(), mesh)
        engine.clients["c1"] = OpenClient(ClientInfo("c1", "m", 8, weight_version=7, adapter="client-0"))
        try:
            await engine.sample("c1", [[1, 2]], None)
            await engine.sample("c1", [[1, 2]], None)             # same replicas, same weights: no push
            replicas[0] = ["10.0.0.2:50051", "10.0.0.3:50051"]     # a replica scaled in
            await engine.sample("c1", [[1, 2]], None)
            return mesh.pushed_to
        finally:
            await mesh.close()

    assert asyncio.run(main()) == [["10.0.0.2:50051"], ["10.0.0.2:50051", "10.0.0.3:50051"]]
