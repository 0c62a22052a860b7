"""services/trainer/weights/gather.py on a 4-rank gloo mesh (dp=2 x tp=2): every weight layout the trainer produces
(FSDP's Shard(0), FSDP over TP's _StridedShard, TP's row/column shards, uneven splits, a DP-only weight, a
plain replicated tensor) arrives whole on the sender, equal to DTensor.full_tensor(), through several buckets;
the other ranks get nothing."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WORLD = 4


def _weights(mesh) -> nn.Module:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    g = torch.Generator().manual_seed(0)
    # dp_only first: a rank off the sender's mesh must send nothing for it, or every later weight shifts.
    full = {"dp_only": torch.randn(9, generator=g), "strided": torch.randn(8, 6, generator=g),
            "uneven": torch.randn(7, 3, generator=g), "cols": torch.randn(5, 6, generator=g),
            "plain": torch.randn(4, 4, generator=g), "both": torch.randn(6, 10, generator=g)}
    dp_mesh = mesh["dp"]
    layouts = {"strided": (mesh, [_StridedShard(0, split_factor=2), Shard(0)]),
               "uneven": (mesh, [Shard(0), Replicate()]), "cols": (mesh, [Replicate(), Shard(1)]),
               "dp_only": (dp_mesh, [Shard(0)]), "both": (mesh, [Shard(1), Shard(0)])}
    module = nn.Module()
    for name, t in full.items():
        value = t if name not in layouts else distribute_tensor(t, *layouts[name])
        module.register_parameter(name, nn.Parameter(value, requires_grad=False))
    return module, full


def _worker(rank: int, out: str, bucket_bytes: int) -> None:
    # A FileStore in the test's folder: no TCP port to pick and release before the ranks bind it.
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=WORLD)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        from services.trainer.weights.gather import stage_gatherers

        mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
        module, full = _weights(mesh["dp", "tp"])
        expected = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p.data) for n, p in module.named_parameters()}
        got = stage_gatherers(mesh).gather(dict(module.named_parameters()), dtype=torch.float32, where="cpu",
                                                  bucket_bytes=bucket_bytes)
        torch.save({"got": got, "expected": expected, "full": full}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("bucket_bytes", [100, 10 ** 6], ids=["a-bucket-per-weight", "one-bucket"])
def test_every_layout_arrives_whole_on_the_sender_only(tmp_path, bucket_bytes):
    mp.start_processes(_worker, args=(str(tmp_path), bucket_bytes), nprocs=WORLD, start_method="spawn")
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    assert all(r["got"] is None for r in results[1:])
    got, expected, full = results[0]["got"], results[0]["expected"], results[0]["full"]
    assert list(got) == list(full)
    for name, t in full.items():
        assert torch.equal(expected[name], t), name            # the layouts are what the test means
        assert torch.equal(got[name], t), name


@pytest.mark.parametrize("bucket_bytes", [1, 10 ** 9])
def test_buckets_cut_by_bytes_keep_every_name_once_in_order(bucket_bytes):
    from services.trainer.weights.gather import _buckets

    names, sizes = ["a", "b", "c", "d"], [40, 40, 200, 8]
    buckets = list(_buckets(names, sizes, bucket_bytes))
    assert [n for b in buckets for n in b] == names
    assert len(buckets) == (4 if bucket_bytes == 1 else 1)


def test_the_push_benchmark_runs_on_a_tiny_cpu_mesh_and_the_non_sender_holds_no_weights(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "weight_gather.json"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                    "bench/weight_gather.py", "--size", "tiny", "--repeats", "1", "--out", str(out)],
                   cwd=repo, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)
    result = json.loads(out.read_text())
    before, now = result["non_sender"]["full_tensor_every_rank"], result["non_sender"]["bucketed_gather_to_sender"]
    assert before["host_weight_bytes"] == result["sync_bytes"] and now["host_weight_bytes"] == 0
    assert result["sender"]["bucketed_gather_to_sender"]["host_weight_bytes"] == result["sync_bytes"]
