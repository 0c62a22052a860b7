"""Async GRPO with rollout and trainer on two GPUs (skipped with fewer): bench/e2e_grpo.py --placement split puts
the rollout replica on cuda:1 and trainer and reference on cuda:0. A synchronous and an async k = 2 run (partial
rollouts, bypass correction) of the 0.5B shape on the long-tailed workload, a few steps each: the async run trains
within its staleness bound with per-token versions, and its generation overlaps the training, shown by the runs'
own RPC records (a Generate on the replica runs while a TrainActor runs on the trainer; never in the sync run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                                  reason="needs 2 GPUs")]

REPO = Path(__file__).resolve().parents[2]
STEPS = 5


def transport() -> str:
    """NCCL between the two GPUs when CuPy is there (its sender needs it), else the plain gRPC stream."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "grpc"
    return "nccl"


def run(tmp_path: Path, name: str, *mode: str) -> tuple[dict, list[dict]]:
    """One e2e run on the split placement; its result JSON and the services' RPC records."""
    work = tmp_path / name
    out = tmp_path / f"{name}.json"
    env = dict(os.environ, PYTHONPATH=f"{REPO}:{REPO / 'protos'}", OMP_NUM_THREADS="4")
    subprocess.run([sys.executable, "bench/e2e_grpo.py", "run", "--device", "cuda", "--shape", "qwen2.5-0.5b",
                    "--placement", "split", "--weight-transport", transport(), "--lengths", "longtail",
                    "--steps", str(STEPS), "--warmup-steps", "1", "--seed", "1", "--work-dir", str(work),
                    "--out", str(out), *mode], cwd=REPO, env=env, check=True, timeout=600)
    records = [json.loads(line) for f in work.glob("meshrl-*/timing/*.jsonl")
               for line in f.read_text().splitlines() if line.strip()]
    return json.loads(out.read_text()), records


def overlaps(records: list[dict]) -> int:
    """Pairs of (rollout Generate, trainer TrainActor) server calls whose spans intersect."""
    gen = [r for r in records if r.get("side") == "server" and r["role"] == "rollout" and r["rpc"] == "Generate"]
    train = [r for r in records if r.get("side") == "server" and r["role"] == "trainer" and r["rpc"] == "TrainActor"]
    return sum(g["start"] < t["end"] and t["start"] < g["end"] for g in gen for t in train)


def test_async_k2_on_two_gpus_trains_and_hides_the_generation(tmp_path):
    sync, sync_records = run(tmp_path, "sync")
    k2, k2_records = run(tmp_path, "k2", "--async-k", "2", "--partial", "continue", "--correction", "bypass")
    for result in (sync, k2):
        assert result["placement"] == "split" and [r["step"] for r in result["steps"]] == list(range(1, STEPS + 1))
        assert result["recipe"]["weight_sync"]["transport"] == transport()
    assert all(r["staleness_max"] <= 2 for r in k2["steps"])
    assert max(r["staleness_max"] for r in k2["steps"]) >= 1
    # the long tail keeps the replica decoding while updates land: tokens of several weight versions in one sample
    assert sum(r["partial_samples"] or 0 for r in k2["steps"]) > 0
    assert overlaps(sync_records) == 0 and overlaps(k2_records) > 0
    # the step waits for less generation than the synchronous step decodes (two phases of these two runs)
    assert k2["phase_seconds_median"]["generate"] < sync["phase_seconds_median"]["generate"]
