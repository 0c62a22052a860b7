"""A resumed run's recorded config takes the addresses of the pools it reaches now, but keeps the env addresses the
rollout replicas were started with: a restarted coordinator checks the replicas against them (the composed mesh
restarts its coordinator mid-run, tests/integration/test_compose_up.py)."""

from __future__ import annotations

from coordinator.recipe.config import RunConfig
from coordinator.training.algorithms import live_addresses


def test_a_resume_takes_the_live_pools_but_keeps_the_recorded_env_addresses():
    recorded = {"rollout": {"servers": ["old:1"], "dns": None, "registry": False, "n": 8},
                "env": {"servers": [], "dns": "env:50051", "registry": False},
                "trainer": {"address": "old-trainer:2"}}
    cfg = RunConfig.model_validate({"rollout": {"servers": ["new:1"]}, "trainer": {"address": "new-trainer:2"}})
    out = live_addresses(recorded, cfg)
    assert out["rollout"] == {"servers": ["new:1"], "dns": None, "registry": False, "n": 8}
    assert out["trainer"]["address"] == "new-trainer:2"
    assert out["env"] == recorded["env"]                # not the run config's empty env section
    assert recorded["rollout"]["servers"] == ["old:1"]  # the record itself is not changed
