"""The run API from a client that imports nothing of meshrl: examples/run_api/two_runs.py finds the
coordinator's methods by reflection and starts two runs with their own learning rates and reward components
against the same running services; each run's metrics show its own values."""

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from coordinator.runapi.service import CoordinatorSettings, start as start_coordinator
from services.common.config import load_config
from services.local import start_local_mesh

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "run_api" / "two_runs.py"


def services_config(model_path: str, run_dir: Path) -> dict:
    """What the services start with: lr 2e-5 and the default exact_match reward."""
    return {"model": {"path": model_path}, "rollout": {"n": 2, "max_tokens": 4}, "actor": {"lr": 2e-5},
            "data": {"train_files": ["examples/arith/data/train.jsonl"],
                     "heldout_files": ["examples/arith/data/heldout.jsonl"], "heldout_size": 2,
                     "rollout_batch_size": 2},
            "run": {"num_steps": 2, "run_dir": str(run_dir)}}


def test_a_reflection_only_script_runs_two_runs_each_with_its_own_lr_and_reward_components(arith_model_path,
                                                                                            tmp_path):
    async def main():
        mesh = await start_local_mesh(services_config(arith_model_path, tmp_path / "runs"), num_rollout=1,
                                      num_reference=0)
        server, port, engine = await start_coordinator(load_config(CoordinatorSettings, data={}), "127.0.0.1:0")
        recipe = tmp_path / "services.yaml"
        recipe.write_text(yaml.safe_dump(mesh.config))
        # A clean environment for the script: no PYTHONPATH, so nothing of meshrl could be imported by accident.
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        try:
            return await asyncio.to_thread(
                subprocess.run, [sys.executable, str(SCRIPT), "--coordinator", f"127.0.0.1:{port}", "--config",
                                 str(recipe)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        finally:
            await engine.close()
            await server.stop(0)
            await mesh.stop()

    result = asyncio.run(main())
    assert result.returncode == 0, result.stderr
    first, second = (json.loads(line) for line in result.stdout.splitlines())
    assert "shown" in first and "shown" in second, result.stdout
    assert first["shown"]["state"] == second["shown"]["state"] == "RUN_STATE_COMPLETED"
    assert (first["shown"]["steps"], second["shown"]["steps"]) == (2, 2)
    assert first["shown"]["actor/lr"] == [1e-4] and second["shown"]["actor/lr"] == [3e-6]
    assert first["shown"]["reward components"] == ["reward/exact_match"]
    assert second["shown"]["reward components"] == ["reward/boxed", "reward/em"]
    # The second run starts from model.path, as the first did, not from the first one's end.
    assert first["shown"]["heldout_accuracy_before"] == second["shown"]["heldout_accuracy_before"] is not None


def test_without_coordinator_the_script_uses_the_running_meshs(tmp_path):
    """As `Client()` and concurrent_runs.py do: the mesh `meshrl mesh` recorded, not a fixed 127.0.0.1:50050."""
    from coordinator.runapi.store import RunRecord
    from tests.integration.stored_coordinator import StoredCoordinator

    recipe = tmp_path / "services.yaml"
    recipe.write_text(yaml.safe_dump({"run": {"num_steps": 1}}))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MESHRL_COORDINATOR")}
    with StoredCoordinator([RunRecord(run_id="r", config="")]) as address:
        (tmp_path / "cache" / "meshrl").mkdir(parents=True)
        (tmp_path / "cache" / "meshrl" / "mesh.json").write_text(json.dumps({"coordinator": address, "pid": 1}))
        result = subprocess.run([sys.executable, str(SCRIPT), "--config", str(recipe)], cwd=tmp_path,
                                env={**env, "XDG_CACHE_HOME": str(tmp_path / "cache")}, capture_output=True,
                                text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    # That coordinator answered each run (it has no trainer, so it refuses them by the key that names one).
    answers = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(answers) == 2 and all("trainer" in a["refused"] for a in answers), result.stdout
