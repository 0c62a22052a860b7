"""Async runs on real services (the tiny arith model): with run.max_staleness k, no sample trains more than k
weight versions behind, k batches stay in flight, every prompt is trained once in data-position order; with
partial rollouts the samples' per-token versions reach the run."""

import asyncio
import json
import time
from pathlib import Path

import pytest
import yaml

from coordinator.client import Client
from coordinator.runapi.service import CoordinatorSettings, start as start_coordinator
from services.common.config import load_config
from services.local import start_local_mesh

pytestmark = pytest.mark.slow

NUM_STEPS, BATCH = 5, 2


def config(model_path: str, run_dir: Path, k: int, **rollout) -> dict:
    return {
        "model": {"path": model_path},
        "rollout": {"n": 4, "temperature": 1.0, "max_tokens": 6, **rollout},
        "actor": {"lr": 1e-5},
        "algorithm": {"adv_estimator": "grpo"},
        "data": {"train_files": ["examples/arith/data/train.jsonl"], "rollout_batch_size": BATCH},
        "run": {"num_steps": NUM_STEPS, "run_dir": str(run_dir), "async_mode": True, "max_staleness": k,
                "tensorboard": False},
    }


def records(run_dir: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def check_run(run_dir: Path, k: int) -> dict:
    """Asserts the bound on every sample; returns what the test reports."""
    steps = {int(m["step"]): m for m in records(run_dir, "metrics.jsonl") if "reward_mean" in m}
    assert sorted(steps) == list(range(1, NUM_STEPS + 1))
    samples = records(run_dir, "samples.jsonl")
    # A step trains the weights of version (its weight_version after the sync) - 1.
    lags = [int(steps[s["step"]]["weight_version"]) - 1 - s["weight_version"] for s in samples]
    assert min(lags) >= 0 and max(lags) == k, (k, lags)
    assert [steps[s]["staleness_max"] for s in sorted(steps)] == [min(s - 1, k) for s in sorted(steps)]
    assert all(steps[s]["async/in_flight"] == k for s in steps)
    # Each step's prompts are the next BATCH of the stream: every data position once, in order.
    assert [steps[s]["data_position"] for s in sorted(steps)] == [BATCH * s for s in sorted(steps)]
    prompts = [s["prompt"] for s in samples]
    assert len(prompts) == NUM_STEPS * BATCH * 4
    partial = check_token_versions(steps, samples, k)
    return {"lags": lags, "partial": partial}


def check_token_versions(steps: dict[int, dict], samples: list[dict], k: int) -> int:
    """A sample that several weight versions generated lists each token's version: one per token, never going
    back, its first token's version the sample's, none newer than the weights its step trains or more than k
    behind them; its step's async/partial_samples counts exactly those samples. Returns how many there were."""
    partial = [s for s in samples if "weight_versions" in s]
    for s in partial:
        versions, trained = s["weight_versions"], int(steps[s["step"]]["weight_version"]) - 1
        assert len(versions) == s["response_length"] and len(set(versions)) > 1, s
        assert versions == sorted(versions) and versions[0] == s["weight_version"], s
        assert trained - k <= versions[0] and versions[-1] <= trained, (trained, s)
    for step, m in steps.items():
        assert m["async/partial_samples"] == sum(s["step"] == step for s in partial), (step, m)
    return len(partial)


def hold_for_a_swap(engine, bound_s: float = 15.0):
    """Each partial-rollout decode but a run's first waits after its first token until a weight update is posted
    (the next step's, which does not need this batch when k >= 2), so that the update lands inside it. No update
    comes for a run's first decode (its batch is the one step 1 trains on): it is not held (holding it cost
    `bound_s`, the bound on any wait). Returns what to call as each run starts."""
    between_steps, first_decode = engine._between_steps, [True]

    def held(rows, first_token: int) -> bool:
        deadline = time.monotonic() + bound_s
        if first_token == 2 and first_decode[0]:
            first_decode[0] = False
            deadline = 0.0
        while first_token == 2 and not engine._swaps and time.monotonic() < deadline:
            time.sleep(0.01)                   # this decode thread only; the update is posted by another
        return between_steps(rows, first_token)
    engine._between_steps = held
    return lambda: first_decode.__setitem__(0, True)


def record_updates(engine) -> list[int]:
    """The weight versions the engine applies, in order."""
    applied, apply_update = [], engine.apply_update

    async def recorded(version, tensors, **kw):
        applied.append(version)
        return await apply_update(version, tensors, **kw)
    engine.apply_update = recorded
    return applied


def test_no_sample_trains_more_than_k_versions_behind_for_k_1_2_3(arith_model_path, tmp_path):
    cfgs = {k: config(arith_model_path, tmp_path / f"k{k}", k) for k in (1, 2, 3)}
    cfgs[2]["rollout"]["partial_rollouts"] = "continue"
    cfgs[3]["rollout"]["partial_rollouts"] = "pause"

    async def main():
        mesh = await start_local_mesh(cfgs[1], num_rollout=1)
        new_run = hold_for_a_swap(mesh.engines["rollout"][0].engine)
        applied = record_updates(mesh.engines["rollout"][0].engine)
        server, port, engine = await start_coordinator(load_config(CoordinatorSettings, data={}), "127.0.0.1:0")
        client = Client(f"127.0.0.1:{port}")
        try:
            out = {}
            for k, cfg in cfgs.items():
                new_run()
                run_cfg = {**mesh.config, "rollout": {**mesh.config["rollout"], **cfg["rollout"]}, "run": cfg["run"]}
                run_id = await asyncio.to_thread(client.start_run, yaml.safe_dump(run_cfg))
                final = await asyncio.to_thread(client.wait, run_id)
                assert final.state == "COMPLETED", final.message
                out[k] = check_run(Path(final.run_dir), k)
                # The run's weights reach the replica once each: a later run's batches launched together push
                # its version 0 once (they used to push it once each, the last ones after step 1 had trained).
                assert applied == sorted(set(applied)) and len(applied) == NUM_STEPS + (k > 1), (k, applied)
                applied.clear()
            return out
        finally:
            client.close()
            await engine.close()
            await server.stop(0)
            await mesh.stop()

    out = asyncio.run(main())
    assert out[1]["partial"] == 0                       # partial rollouts off: every sample is one version's
    assert out[2]["partial"] > 0 and out[3]["partial"] > 0     # updates landed inside decodes
    print({k: {"max_lag": max(v["lags"]), "partial_samples": v["partial"]} for k, v in out.items()})
