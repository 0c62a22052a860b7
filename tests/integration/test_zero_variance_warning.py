"""A run whose reward is 0 for every sample (exact_match against answers the model cannot write) on a real mesh
(every service a gRPC server on port 0, the coordinator's run API): `meshrl run` prints the zero-variance warning
exactly once, under its step lines, and the coordinator logs it exactly once."""

import asyncio
import json
import logging

import yaml
from typer.testing import CliRunner

from coordinator.runapi.service import CoordinatorSettings, start as start_coordinator
from coordinator.recipe.no_signal import METRIC
from services.common.config import load_config
from services.local import start_local_mesh

WARNING = "no prompt group had any reward variance for 3 steps in a row"


def test_a_run_whose_reward_is_always_zero_warns_once_in_the_console_and_once_in_the_coordinator_log(
        arith_model_path, tmp_path, caplog):
    from coordinator.cli import app

    data = tmp_path / "impossible.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": "not a number", "data_source": "arith"}) + "\n"
                            for i in range(8)))
    config = {"model": {"path": arith_model_path}, "rollout": {"n": 4, "temperature": 1.0, "max_tokens": 4},
              "reward": {"components": [{"name": "exact_match", "weight": 1.0}]},
              "data": {"train_files": [str(data)], "heldout_files": [str(data)], "heldout_size": 2,
                       "rollout_batch_size": 2},
              "run": {"num_steps": 5, "run_dir": str(tmp_path / "runs")}}

    async def main():
        mesh = await start_local_mesh(config, num_rollout=1, num_reference=0)
        server, port, engine = await start_coordinator(load_config(CoordinatorSettings, data={}), "127.0.0.1:0")
        try:
            recipe = tmp_path / "zero.yaml"
            recipe.write_text(yaml.safe_dump(mesh.config))
            return await asyncio.to_thread(CliRunner().invoke, app,
                                           ["run", str(recipe), "--coordinator", f"127.0.0.1:{port}"])
        finally:
            await engine.close()
            await server.stop(0)
            await mesh.stop()

    with caplog.at_level(logging.WARNING, logger="meshrl.runs"):
        result = asyncio.run(main())
    assert result.exit_code == 0, result.output
    steps = [line for line in result.output.splitlines() if line.startswith("step ")]
    assert len(steps) == 5 and all(" reward 0.000 " in line for line in steps)
    assert result.output.count(WARNING) == 1
    # Printed under step 3's line, the third step with no variance.
    lines = result.output.splitlines()
    assert lines[lines.index(next(line for line in lines if WARNING in line)) - 1].startswith("step   3/5")
    logged = [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]
    assert len(logged) == 1
    metrics = [json.loads(line) for line in next((tmp_path / "runs").iterdir()).joinpath("metrics.jsonl")
               .read_text().splitlines()]
    assert [m[METRIC] for m in metrics if METRIC in m] == [1.0] * 5
