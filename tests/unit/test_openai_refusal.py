"""An RL run refuses rollout replicas that cannot take weight updates (an `openai` proxy without
rollout.weights_dir, or of a server without vLLM's weight-update endpoints); DPO takes any."""

import pytest

from coordinator.recipe import run_settings as rs
from coordinator.recipe.config import RunConfig
from coordinator.recipe.preflight import check_rollout_weights
from services.common.config import load_config


def cfg(**sections) -> RunConfig:
    return load_config(RunConfig, data=sections)


def test_preflight_refuses_an_openai_replica_without_weights_dir_for_grpo_only():
    openai = {"engine": "openai", "server_url": "http://h:8000/v1"}
    with pytest.raises(ValueError, match=r"^rollout.weights_dir: .*grpo"):
        check_rollout_weights(cfg(rollout=openai))
    check_rollout_weights(cfg(rollout={**openai, "weights_dir": "/shared/w"}))
    check_rollout_weights(cfg(rollout=openai, algorithm={"kind": "dpo"}))


@pytest.mark.parametrize("updates,refused", [("none", True), ("unknown", True), ("vllm_http", False), (None, False)])
def test_a_running_replica_that_cannot_take_weights_is_refused_for_rl_and_taken_for_dpo(updates, refused):
    details = {"server_url": "http://h:8000/v1", "weight_updates_why": "no weight-update endpoints"}
    if updates is not None:
        details["weight_updates"] = updates
    running = [rs.Running("rollout", "127.0.0.1:9", {}, details)]
    if refused:
        with pytest.raises(ValueError, match=r"^rollout.servers: replica 127.0.0.1:9 .*no weight-update endpoints"):
            rs.check_rollout_weights(cfg(), running)
    else:
        rs.check_rollout_weights(cfg(), running)
    rs.check_rollout_weights(cfg(algorithm={"kind": "dpo"}), running)
