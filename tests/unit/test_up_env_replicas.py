"""How many env replicas `meshrl up` starts, and the checks before anything starts for agent loops that need the env
role or the rollout HTTP API (proxy mode)."""

from __future__ import annotations

import pytest
import yaml

from coordinator.cli import runs as cli_runs
from coordinator.recipe.preflight import check_proxy_agent


def _recipe(tmp_path, data: dict, overrides: dict[str, str] | None = None):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    overrides = overrides or {}
    raw, cfg = cli_runs._load_recipe(path, {}, overrides)
    return cfg, raw, overrides


@pytest.mark.parametrize("data, overrides, expected", [
    ({}, {}, 0),                                                                   # single-turn: no env role
    ({"env": {"builtin_tools": ["calculator"]}}, {}, 1),                          # a section: its replicas (1)
    ({"env": {"replicas": 2}}, {}, 2),
    ({}, {"env.replicas": "3"}, 3),                                               # a flag counts as a section
    ({"rollout": {"agent": {"name": "tool_agent"}}}, {}, 1),                      # tools need one replica
    ({"rollout": {"agent": {"name": "openai_agent", "program": "a.b:c"}, "http_port": 0}}, {}, 0),
    ({"rollout": {"agent": {"name": "tool_agent"}}, "env": {"replicas": 0, "servers": ["h:1"]}}, {}, 0),
    ({"rollout": {"agent": {"name": "tool_agent"}}, "env": {"dns": "env:50051"}}, {}, 0),   # running ones: kept
    ({"env": {"dns": "env:50051", "replicas": 2}}, {}, 2),                      # a count asked for: started
])
def test_meshrl_up_starts_the_env_replicas_the_recipe_asks_for_or_its_agent_needs(tmp_path, data, overrides,
                                                                                   expected):
    assert cli_runs.env_replicas(*_recipe(tmp_path, data, overrides)) == expected


def test_a_tool_agent_with_no_env_replica_to_call_is_refused_naming_env_replicas(tmp_path):
    with pytest.raises(ValueError, match=r"^env\.replicas: 0, and no env.servers or env.dns, but rollout.agent.name "
                                         r"'tool_agent' calls the env role"):
        cli_runs.env_replicas(*_recipe(tmp_path, {"rollout": {"agent": {"name": "tool_agent"}}, "env": {"replicas": 0}}))


@pytest.mark.parametrize("rollout, key", [
    ({"agent": {"name": "openai_agent"}, "http_port": 0}, "rollout.agent.program"),
    ({"agent": {"name": "openai_agent", "program": "pkg.agent:run"}}, "rollout.http_port"),
])
def test_the_openai_agent_loop_needs_its_program_and_the_http_api(tmp_path, rollout, key):
    cfg, _, _ = _recipe(tmp_path, {"rollout": rollout})
    with pytest.raises(ValueError, match=rf"^{key}: "):
        check_proxy_agent(cfg)
    rollout = {**rollout, "http_port": 0, "agent": {**rollout["agent"], "program": "pkg.agent:run"}}
    check_proxy_agent(_recipe(tmp_path, {"rollout": rollout})[0])
