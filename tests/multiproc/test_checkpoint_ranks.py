"""A checkpoint step that fails on one rank of a two-rank trainer is answered by rank 0, and the mesh keeps serving:
every rank's part of a save ends in an exchange of errors (services/trainer/model/checkpoint.py `_together`)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from meshrl.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from services.common.rpc.channel import create_channel
from services.trainer.testing import make_tiny_model

from tests.multiproc.test_trainer_mesh import Launched


def test_a_save_that_fails_on_rank_1_only_is_answered_with_its_path_and_the_mesh_keeps_serving(tmp_path):
    model = make_tiny_model(tmp_path / "model")
    config = tmp_path / "trainer.yaml"
    config.write_text(f"model:\n  path: {model}\nactor:\n  lr: 1.0e-4\n  dp_size: 2\n")
    # Rank 1's RNG file cannot be written (a folder is in its place); rank 0's part of the save succeeds.
    (tmp_path / "ck" / "rng" / "rank1.pt").mkdir(parents=True)
    launched = Launched(config, tmp_path / "torchrun.log", nproc=2)
    try:
        port = launched.wait_ready()

        async def drive():
            async with create_channel(f"127.0.0.1:{port}") as channel:
                stub = trainer_pb2_grpc.TrainerStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await stub.SaveCheckpoint(trainer_pb2.CheckpointRequest(path=str(tmp_path / "ck")), timeout=60)
                saved = await stub.SaveCheckpoint(trainer_pb2.CheckpointRequest(path=str(tmp_path / "ok")),
                                                  timeout=60)
                info = await stub.GetInfo(common_pb2.GetInfoRequest(), timeout=60)
                return failed.value, saved, info

        failed, saved, info = asyncio.run(drive())
    finally:
        launched.stop()
    assert (failed.code(), failed.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT, f"path: cannot save checkpoint '{tmp_path}/ck': a folder is where a file "
                                          f"belongs ('{tmp_path}/ck/rng/rank1.pt')")
    assert not (tmp_path / "ck" / "manifest.json").exists()
    assert saved.path == str(tmp_path / "ok") and (tmp_path / "ok" / "manifest.json").is_file()
    assert info.details["world_size"] == "2"
