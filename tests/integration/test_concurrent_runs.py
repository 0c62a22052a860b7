"""Concurrent LoRA runs on one mesh (docs/many_runs.md): examples/run_api/concurrent_runs.py starts two runs with
their own learning rates on one trainer; both train at once (the second on a named adapter), each with its own
metrics; stopping the first leaves the second's steps going to its end; the second's adapter leaves the trainer
with it; a full-parameter run beside them is refused by name. `meshrl watch` with no run id shows both runs, and the
coordinator's step metrics carry each run's id (the dashboard's run variable)."""

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import yaml
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.runapi.service import CoordinatorSettings, start as start_coordinator
from coordinator.training import remote
from services.common.config import load_config
from services.common.rpc.channel import create_channel
from services.local import start_local_mesh

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "run_api" / "concurrent_runs.py"


def lora_recipe(run_dir: Path) -> dict:
    recipe = yaml.safe_load((REPO / "examples/arith/grpo_lora.yaml").read_text())
    recipe["rollout"].update(replicas=1, n=2, max_tokens=4)
    recipe["data"].update(rollout_batch_size=2, heldout_size=2)
    recipe["run"].update(num_steps=3, eval_every=0, run_dir=str(run_dir))
    return recipe


def test_two_lora_runs_train_at_once_and_stopping_one_leaves_the_other_running(tmp_path):
    async def main():
        mesh = await start_local_mesh(lora_recipe(tmp_path / "runs"), num_rollout=1, num_reference=0)
        server, port, engine = await start_coordinator(load_config(CoordinatorSettings, data={}), "127.0.0.1:0")
        recipe = tmp_path / "mesh.yaml"
        recipe.write_text(yaml.safe_dump(mesh.config))
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        try:
            result = await asyncio.to_thread(
                subprocess.run, [sys.executable, str(SCRIPT), "--coordinator", f"127.0.0.1:{port}", "--config",
                                 str(recipe), "--steps", "4", "--stop-first-after", "1"],
                cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
            channel = create_channel(mesh.addresses["trainer"][0])
            for _ in range(100):        # a run's adapter is deleted as its task winds down, just after its state
                info = await remote.info(remote.trainer_stub(channel))
                if not info.details["named_adapters"]:
                    break
                await asyncio.sleep(0.05)
            await channel.close()
            watched = await asyncio.to_thread(
                subprocess.run, [sys.executable, "-m", "coordinator.cli", "watch", "--once", "--coordinator",
                                 f"127.0.0.1:{port}"], cwd=REPO, env={**env, "COLUMNS": "200"}, capture_output=True,
                text=True, timeout=120)
            return result, info, watched
        finally:
            await engine.close()
            await server.stop(0)
            await mesh.stop()

    result, info, watched = asyncio.run(main())
    assert result.returncode == 0, result.stdout + result.stderr
    first, second = (json.loads(line) for line in result.stdout.splitlines())
    assert first["state"] == "RUN_STATE_STOPPED", first
    assert second["state"] == "RUN_STATE_COMPLETED", second
    assert [s["step"] for s in second["steps"]] == [1, 2, 3, 4]
    assert 1 <= len(first["steps"]) < 4
    # Each run's own learning rate, in its own metrics.
    assert [s["lr"] for s in first["steps"]] == pytest.approx([1e-3] * len(first["steps"]))
    assert [s["lr"] for s in second["steps"]] == pytest.approx([3e-4] * 4)
    # The second run's steps went on after the first was stopped.
    assert any(s["at"] > first["stopped_at"] for s in second["steps"]), (first, second)
    assert second["heldout_accuracy"][1] is not None
    # The first run trains the trainer's run adapter, the second a named adapter of its own beside it.
    assert first["adapter"] == "" and second["adapter"].startswith("lora-slow-")
    # Every run ended: no named adapter is left on the trainer.
    assert info.details["named_adapters"] == ""
    # `meshrl watch` with no run id: both runs, the second on its named adapter (the coordinator's ListRuns order).
    assert watched.returncode == 0, watched.stderr
    lines = watched.stdout.splitlines()
    assert lines[0] == "2 runs on the mesh  0 running, 0 paused, 2 finished", watched.stdout
    rows = {line.split()[0]: line.split() for line in lines[2:4]}
    assert rows[first["run_id"]][1:3] == ["-", "STOPPED"]
    assert rows[second["run_id"]][1:4] == [second["adapter"], "COMPLETED", "4/4"]
    # Each run's steps are its own in the coordinator's metrics (this process served it).
    samples = {(s.name, s.labels.get("run_id"), s.labels.get("phase")): s.value
               for fam in text_string_to_metric_families(generate_latest(REGISTRY).decode()) for s in fam.samples}
    assert samples[("meshrl_coordinator_step_seconds_count", second["run_id"], None)] == 4
    assert 1 <= samples[("meshrl_coordinator_step_seconds_count", first["run_id"], None)] < 4
    assert samples[("meshrl_coordinator_phase_seconds_count", second["run_id"], "generate")] == 4
    assert ("meshrl_coordinator_reward", second["run_id"], None) in samples
