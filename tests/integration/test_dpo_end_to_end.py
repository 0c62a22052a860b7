"""DPO through real services on port 0 (trainer, reference, reward, rollout, coordinator run API, Python client).

A script starts a DPO run like any RL run; held-out preference accuracy rises, the summary and metrics
carry the DPO numbers, and rollout replicas hold the trained weights when they evaluate.
"""

import asyncio
import json
from pathlib import Path

import grpc
import pytest
import yaml

from coordinator.client import Client
from coordinator.recipe.config import RunConfig
from coordinator.runapi.service import CoordinatorSettings, start as start_coordinator
from coordinator.training import remote
from coordinator.training.dpo import load_pairs
from services.common.rpc.channel import create_channel
from services.common.config import load_config
from services.common.tensors.modeling import load_tokenizer
from services.local import start_local_mesh, start_role

pytestmark = pytest.mark.slow

DPO_METRICS = ("dpo/loss", "dpo/rewards/chosen", "dpo/rewards/rejected", "dpo/rewards/margins",
               "dpo/rewards/accuracy", "dpo/logps/chosen", "dpo/logps/rejected", "dpo/grad_norm", "dpo/lr")


def dpo_config(model_path: str, run_dir: Path, **sections) -> dict:
    cfg = {
        "model": {"path": model_path},
        "rollout": {"temperature": 0.0, "max_tokens": 6},
        "reward": {"components": [{"name": "exact_match", "weight": 1.0}]},
        "actor": {"lr": 5e-5},
        "algorithm": {"kind": "dpo"},
        "dpo": {"beta": 0.1, "batch_size": 16},
        "data": {"train_files": ["examples/arith/data/dpo_train.jsonl"],
                 "heldout_files": ["examples/arith/data/dpo_heldout.jsonl"], "heldout_size": 32},
        "run": {"num_steps": 6, "run_dir": str(run_dir)},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return cfg


async def with_mesh(config: dict, body, *, num_reference: int = 1):
    mesh = await start_local_mesh(config, num_rollout=1, num_reference=num_reference)
    server, port, engine = await start_coordinator(load_config(CoordinatorSettings, data={}), "127.0.0.1:0")
    try:
        return await body(mesh, f"127.0.0.1:{port}")
    finally:
        await engine.close()
        await server.stop(0)
        await mesh.stop()


def records_of(run_dir: str) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_a_dpo_run_through_the_run_api_raises_held_out_preference_accuracy(arith_model_path, tmp_path):
    async def body(mesh, address):
        client = Client(address)
        run_id = await asyncio.to_thread(client.start_run, yaml.safe_dump(mesh.config))
        final = await asyncio.to_thread(client.wait, run_id)
        assert final.state == "COMPLETED", final.message
        assert final.step == 6 and final.weight_version == 6
        # The trainer and the rollout replica (synced before the final greedy evaluation) agree.
        trainer = mesh.engines["trainer"][0]
        assert trainer.rank.weight_version == 6 and trainer.rank.actor.step == 6
        async with create_channel(mesh.addresses["rollout"][0]) as channel:
            assert (await remote.info(remote.rollout_stub(channel))).weight_version == 6
        client.close()
        return final

    final = asyncio.run(with_mesh(dpo_config(arith_model_path, tmp_path), body))
    records = records_of(final.run_dir)
    before, after = records[0], records[-1]
    assert before["step"] == 0 and after.get("final") == 1.0
    # Policy = reference before training: every implicit-reward margin is exactly 0.
    assert before["heldout_preference_accuracy"] == 0.0 and before["heldout_reward_margin"] == 0.0
    assert after["heldout_preference_accuracy"] >= 0.75
    assert after["heldout_reward_margin"] > 0
    assert after["heldout_logp_accuracy"] > before["heldout_logp_accuracy"]
    # The shipped SFT model's greedy mistakes are the rejected answers, so greedy task accuracy rises too.
    assert after["heldout_accuracy"] > before["heldout_accuracy"]
    steps = [r for r in records if "reward_mean" in r]
    assert [int(r["step"]) for r in steps] == list(range(1, 7))
    for r in steps:
        for key in DPO_METRICS:
            assert key in r, key
        assert r["dpo/num_pairs"] == 16 and r["time/train"] > 0 and r["time/reference"] > 0
        assert r["reward_mean"] == r["dpo/rewards/margins"]
    assert steps[0]["dpo/loss"] == pytest.approx(0.6931, abs=1e-3)      # log 2: policy = reference at step 1
    assert steps[-1]["dpo/rewards/margins"] > 0
    summary = json.loads((Path(final.run_dir) / "summary.json").read_text())
    assert summary["algorithm"] == "dpo" and summary["steps"] == 6
    assert summary["heldout_preference_accuracy_before"] == 0.0
    assert summary["heldout_preference_accuracy_after"] == after["heldout_preference_accuracy"]
    assert summary["heldout_accuracy_before"] == before["heldout_accuracy"]
    assert summary["heldout_accuracy_after"] == after["heldout_accuracy"]
    assert len(summary["reward_curve"]) == 6


def test_precomputed_reference_logprobs_and_custom_keys_need_no_reference_replica(arith_model_path, tmp_path):
    # Reference sums from the model itself (as a precompute script would), under renamed keys.
    async def scored_rows():
        cfg = load_config(RunConfig, data=dpo_config(arith_model_path, tmp_path))
        pairs = load_pairs(["examples/arith/data/dpo_train.jsonl"], cfg, load_tokenizer(arith_model_path),
                           source="test")[:40]
        server, port, _ = await start_role("reference", {"model": {"path": arith_model_path}})
        try:
            async with create_channel(f"127.0.0.1:{port}") as channel:
                sums = await remote.sequence_logprob_sums(
                    remote.reference_stub(channel), [p.prompt_ids for p in pairs] * 2,
                    [p.chosen_ids for p in pairs] + [p.rejected_ids for p in pairs])
        finally:
            await server.stop(0)
        rows = [json.loads(line) for line in Path("examples/arith/data/dpo_train.jsonl").read_text().splitlines()][:40]
        return [{"question": r["prompt"], "good": r["chosen"], "bad": r["rejected"],
                 "ref": {"good": sums[i], "bad": sums[40 + i]}} for i, r in enumerate(rows)]

    rows = asyncio.run(scored_rows())
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = dpo_config(arith_model_path, tmp_path, run={"num_steps": 2},
                        data={"train_files": [str(data)], "heldout_files": [], "prompt_key": "question"},
                        dpo={"chosen_key": "good", "rejected_key": "bad", "ref_chosen_key": "ref.good",
                             "ref_rejected_key": "ref.bad", "heldout_files": [str(data)]})

    async def body(mesh, address):
        client = Client(address)
        run_id = await asyncio.to_thread(client.start_run, yaml.safe_dump(mesh.config))
        final = await asyncio.to_thread(client.wait, run_id)
        assert final.state == "COMPLETED", final.message
        # Without precomputed sums, a DPO run without a reference pool is refused up front, naming the key.
        bad = dict(mesh.config, dpo={**mesh.config["dpo"], "ref_chosen_key": "missing"})
        with pytest.raises(grpc.RpcError) as err:
            await asyncio.to_thread(client.start_run, yaml.safe_dump(bad))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "reference.servers" in err.value.details()
        client.close()
        return final

    final = asyncio.run(with_mesh(config, body, num_reference=0))
    records = records_of(final.run_dir)
    steps = [r for r in records if "reward_mean" in r]
    assert len(steps) == 2
    # The dataset's reference equals the starting policy, so the first step starts at log 2.
    assert steps[0]["dpo/loss"] == pytest.approx(0.6931, abs=1e-3)
    assert records[-1]["heldout_preference_accuracy"] > 0.5


def test_meshrl_up_runs_the_dpo_example_and_writes_summary_and_report(arith_model_path, tmp_path):
    import os
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "up", "examples/arith/dpo.yaml", "--run-dir", str(tmp_path),
         "--model.path", arith_model_path, "--run.num_steps", "2", "--data.heldout_size", "16"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "step   1/2  dpo loss" in out and "step   2/2  dpo loss" in out
    assert "held-out preference accuracy 0.0% ->" in out
    assert "held-out accuracy before" in out.strip().splitlines()[-1]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.name.startswith("arith-dpo")]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["algorithm"] == "dpo" and summary["steps"] == 2
    assert (run_dir / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
