"""Damaged, crafted and misplaced checkpoints: every failure answers at once with the path and the cause, nothing
in a checkpoint runs code, and a checkpoint is loaded only when every file matches its manifest."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import pickle
import shutil
from pathlib import Path

import grpc
import pytest
import yaml
from torch.distributed.checkpoint.api import CheckpointException

from meshrl.v1 import trainer_pb2, trainer_pb2_grpc
from services.common.rpc.channel import create_channel
from services.common.config import load_config
from services.common.errors import passes_through
from services.common.rpc.server import status_for
from services.trainer.model import checkpoint
from services.trainer.config import TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.servicer import start
from services.trainer.testing import make_tiny_model

MARKER = Path("/tmp/meshrl-test-crafted-pickle-ran")


class Payload:
    """A pickle that would create MARKER when unpickled by an unrestricted loader."""

    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> TrainerEngine:
    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    return TrainerEngine(load_config(TrainerSettings, data={"model": {"path": model}, "actor": {"lr": 1e-2}}))


@pytest.fixture(scope="module")
def saved(engine, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ck") / "good"
    engine.save_checkpoint(str(path))
    return path


def copy(saved: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / "ck"))


def refused(fn, *args) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(BaseException) as info:
        fn(*args)
    return status_for(info.value)


def rewrite_manifest(path: Path) -> None:
    """What someone who crafts a checkpoint can do too: a manifest that matches the crafted files."""
    files = {name: {"bytes": (path / name).stat().st_size, "crc32": checkpoint._crc(path / name)}
             for name in checkpoint._files(path)}
    (path / checkpoint.MANIFEST).write_text(json.dumps({"files": files}))


def test_a_saved_checkpoint_lists_every_file_in_its_manifest_and_loads_back(engine, saved):
    files = json.loads((saved / "manifest.json").read_text())["files"]
    assert sorted(files) == ["dcp/.metadata", "dcp/__0_0.distcp", "rng/rank0.pt", "trainer_state.json"]
    assert engine.load_checkpoint(str(saved))["weight_version"] == engine.rank.weight_version


def test_flipped_bytes_in_a_shard_are_refused_naming_the_file(engine, saved, tmp_path):
    ck = copy(saved, tmp_path)
    shard = ck / "dcp" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert refused(engine.load_checkpoint, str(ck)) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        f"path: checkpoint '{ck}' is damaged: dcp/__0_0.distcp does not match its checksum in manifest.json")


def test_a_truncated_shard_is_refused_naming_the_file_and_its_size(engine, saved, tmp_path):
    ck = copy(saved, tmp_path)
    shard = ck / "dcp" / "__0_0.distcp"
    size = shard.stat().st_size
    os.truncate(shard, 100)
    assert refused(engine.load_checkpoint, str(ck)) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        f"path: checkpoint '{ck}' is damaged: dcp/__0_0.distcp has 100 bytes, its manifest.json says {size} "
        f"(truncated or replaced)")


def test_a_checkpoint_without_its_manifest_is_refused_as_incomplete(engine, saved, tmp_path):
    ck = copy(saved, tmp_path)
    (ck / "manifest.json").unlink()
    assert refused(engine.load_checkpoint, str(ck)) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        f"path: '{ck}' is not a complete checkpoint: manifest.json is missing (the save did not finish, or the "
        f"folder is not a meshrl checkpoint)")


def test_a_crafted_pickle_as_dcp_metadata_is_refused_and_never_runs(engine, saved, tmp_path):
    MARKER.unlink(missing_ok=True)
    ck = copy(saved, tmp_path)
    (ck / "dcp" / ".metadata").write_bytes(pickle.dumps(Payload()))
    rewrite_manifest(ck)
    assert refused(engine.load_checkpoint, str(ck)) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        f"path: checkpoint '{ck}' is refused: dcp/.metadata is not DCP metadata (it names posix.system, which "
        f"is not a checkpoint metadata type)")
    assert not MARKER.exists()


def test_a_crafted_pickle_as_trainer_state_or_rng_state_is_refused_and_never_runs(engine, saved, tmp_path):
    MARKER.unlink(missing_ok=True)
    ck = copy(saved, tmp_path)
    (ck / "trainer_state.json").write_bytes(pickle.dumps(Payload()))
    rewrite_manifest(ck)
    assert refused(engine.load_checkpoint, str(ck)) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        f"path: checkpoint '{ck}' is damaged: trainer_state.json is not valid (UnicodeDecodeError)")
    shutil.copy(saved / "trainer_state.json", ck / "trainer_state.json")
    (ck / "rng" / "rank0.pt").write_bytes(pickle.dumps(Payload()))
    rewrite_manifest(ck)
    code, message = refused(engine.load_checkpoint, str(ck))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert message.startswith(f"path: cannot load checkpoint '{ck}': UnpicklingError: ")
    assert not MARKER.exists()


@pytest.mark.parametrize("method,what", [("save_checkpoint", "save checkpoint"), ("export_hf", "export to")])
def test_saving_or_exporting_to_a_file_or_under_one_is_invalid_argument_naming_the_path(engine, tmp_path, method,
                                                                                     what):
    (tmp_path / "f").write_text("x")
    assert refused(getattr(engine, method), str(tmp_path / "f")) == (
        grpc.StatusCode.INVALID_ARGUMENT, f"path: cannot {what} '{tmp_path}/f': it is a file, not a folder")
    assert refused(getattr(engine, method), str(tmp_path / "f" / "sub")) == (
        grpc.StatusCode.INVALID_ARGUMENT, f"path: cannot {what} '{tmp_path}/f/sub': '{tmp_path}/f' is a file, "
                                          f"not a folder")


def test_loading_from_a_file_under_a_file_or_nothing_is_a_client_error_naming_the_path(engine, tmp_path):
    (tmp_path / "f").write_text("x")
    assert refused(engine.load_checkpoint, str(tmp_path / "f")) == (
        grpc.StatusCode.INVALID_ARGUMENT, f"path: no trainer checkpoint at '{tmp_path}/f': it is a file, not a "
                                          f"folder")
    assert refused(engine.load_checkpoint, str(tmp_path / "f" / "x")) == (
        grpc.StatusCode.INVALID_ARGUMENT, f"path: no trainer checkpoint at '{tmp_path}/f/x': '{tmp_path}/f' is a "
                                          f"file, not a folder")
    assert refused(engine.load_checkpoint, str(tmp_path / "none")) == (
        grpc.StatusCode.NOT_FOUND, f"path: no trainer checkpoint at '{tmp_path}/none'")


def test_a_save_whose_dcp_folder_is_a_file_or_whose_rng_folder_is_a_file_is_invalid_argument(engine, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "dcp").write_text("x")
    assert refused(engine.save_checkpoint, str(tmp_path / "a")) == (
        grpc.StatusCode.INVALID_ARGUMENT, f"path: cannot save checkpoint '{tmp_path}/a': '{tmp_path}/a/dcp' is a "
                                          f"file where the checkpoint's dcp/ folder belongs")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "rng").write_text("x")
    assert refused(engine.save_checkpoint, str(tmp_path / "b")) == (
        grpc.StatusCode.INVALID_ARGUMENT, f"path: cannot save checkpoint '{tmp_path}/b': a file is where a folder "
                                          f"belongs ('{tmp_path}/b/rng')")
    assert not (tmp_path / "b" / "manifest.json").exists()


def _checkpoint_exception(exc: BaseException) -> CheckpointException:
    return CheckpointException("CheckpointException ranks:dict_keys([0])", {0: (exc, None)})


def test_torchs_checkpoint_exceptions_over_grpc_are_answered_with_the_path_and_cause(engine, saved, tmp_path,
                                                                                   monkeypatch):
    """The hang of issue 21: CheckpointException derives from BaseException; a full disk during a save and a read
    failure during a load both answer (with a deadline far below trainer.timeout_s)."""
    def disk_full(*args, **kwargs):
        raise _checkpoint_exception(OSError(errno.ENOSPC, "No space left on device", f"{tmp_path}/s/dcp/x"))

    def unreadable(*args, **kwargs):
        raise _checkpoint_exception(RuntimeError("PytorchStreamReader failed reading zip archive"))

    async def main():
        mesh, port, _ = await start(engine.rank.settings, "127.0.0.1:0", engine=engine)
        try:
            async with create_channel(f"127.0.0.1:{port}") as channel:
                stub = trainer_pb2_grpc.TrainerStub(channel)
                out = []
                for method, path, fake in (("SaveCheckpoint", tmp_path / "s", disk_full),
                                           ("LoadCheckpoint", saved, unreadable)):
                    monkeypatch.setattr(checkpoint.dcp, method.replace("Checkpoint", "").lower(), fake)
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await getattr(stub, method)(trainer_pb2.CheckpointRequest(path=str(path)), timeout=30)
                    out.append((info.value.code(), info.value.details()))
                return out
        finally:
            await mesh.stop(0)

    save, load = asyncio.run(main())
    assert save == (grpc.StatusCode.RESOURCE_EXHAUSTED, f"path: cannot save checkpoint '{tmp_path}/s': no space "
                                                        f"left on device ('{tmp_path}/s/dcp/x')")
    assert load == (grpc.StatusCode.FAILED_PRECONDITION, f"path: cannot load checkpoint '{saved}': RuntimeError: "
                                                        f"PytorchStreamReader failed reading zip archive")
    assert not (tmp_path / "s" / "manifest.json").exists()


def test_a_library_base_exception_maps_to_a_one_line_status_and_interrupts_pass_through():
    code, message = status_for(_checkpoint_exception(ValueError("x")))
    assert (code, message) == (grpc.StatusCode.INTERNAL, "internal error: CheckpointException: CheckpointException "
                                                         "ranks:dict_keys([0])")
    assert all(passes_through(e) for e in (KeyboardInterrupt(), SystemExit(1), asyncio.CancelledError()))
    assert not passes_through(_checkpoint_exception(ValueError("x")))


@pytest.mark.slow
def test_a_periodic_save_that_fails_pauses_the_run_naming_the_path_and_resume_continues_once_fixed(
        arith_model_path, tmp_path):
    from coordinator.client import Client
    from coordinator.runapi.service import CoordinatorSettings, start as start_coordinator
    from services.local import start_local_mesh
    from tests.integration.test_coordinator_run_api import base_config

    config = base_config(arith_model_path, tmp_path, run={"num_steps": 3, "checkpoint_every": 2})
    blocked = tmp_path / "r1" / "checkpoints" / "step_2"
    blocked.parent.mkdir(parents=True)
    blocked.write_text("not a folder")

    def until_not_running(client: Client, run_id: str):
        for _ in range(3000):
            status = client.get_run(run_id)
            if status.state != "RUNNING":
                return status
            __import__("time").sleep(0.05)
        raise AssertionError(f"run {run_id} still RUNNING")

    async def main():
        mesh = await start_local_mesh(config, num_rollout=1)
        server, port, engine = await start_coordinator(load_config(CoordinatorSettings, data={}), "127.0.0.1:0")
        try:
            client = Client(f"127.0.0.1:{port}")
            run_id = await asyncio.to_thread(client.start_run, yaml.safe_dump(mesh.config), "r1")
            paused = await asyncio.to_thread(until_not_running, client, run_id)
            blocked.unlink()
            await asyncio.to_thread(client.resume_run, run_id)
            final = await asyncio.to_thread(until_not_running, client, run_id)
            client.close()
            return paused, final
        finally:
            await engine.close()
            await server.stop(0)
            await mesh.stop()

    paused, final = asyncio.run(main())
    assert (paused.state, paused.message) == (
        "PAUSED", f"saving checkpoint '{blocked}' failed: path: cannot save checkpoint '{blocked}': it is a file, "
                  f"not a folder; fix that checkpoint folder (free space, permissions, or restore an intact copy), "
                  f"then ResumeRun continues from step 1")
    assert final.state == "COMPLETED", final.message
    assert final.checkpoint_path == str(blocked) and (blocked / "manifest.json").is_file()


def test_a_checkpoint_of_another_model_is_refused_before_any_weight_changes(engine, tmp_path):
    from services.common.tensors.weights import named_weights

    other_model = make_tiny_model(tmp_path / "other", vocab_size=40)
    other = TrainerEngine(load_config(TrainerSettings, data={"model": {"path": other_model}, "actor": {"lr": 1e-2}}))
    other.save_checkpoint(str(tmp_path / "other_ck"))
    before = {k: v.clone() for k, v in named_weights(engine.rank.actor.module).items()}
    code, message = refused(engine.load_checkpoint, str(tmp_path / "other_ck"))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert message.startswith(f"path: checkpoint '{tmp_path}/other_ck' does not fit this model: actor ")
    assert all((before[k] == v).all() for k, v in named_weights(engine.rank.actor.module).items())


def test_resuming_from_a_refused_checkpoint_falls_back_to_the_one_before_and_says_so(engine, tmp_path, caplog):
    """coordinator/runapi/checkpoints.py: the run's newest checkpoint never finished (no manifest); the trainer is
    restored from step_1 with step 1's data position, a WARNING names both, and when none loads the newest refusal
    stands."""
    from types import SimpleNamespace

    from coordinator.runapi import checkpoints
    from coordinator.training.context import CheckpointFailed, GuardedTrainer
    from coordinator.runapi.store import MemoryStore, RunRecord

    for step in (1, 2):
        engine.save_checkpoint(str(tmp_path / "checkpoints" / f"step_{step}"))
    newest = tmp_path / "checkpoints" / "step_2"
    (newest / "manifest.json").unlink()
    refusal = (f"loading checkpoint '{newest}' failed: path: '{newest}' is not a complete checkpoint: manifest.json "
               f"is missing (the save did not finish, or the folder is not a meshrl checkpoint)")

    async def main():
        mesh, port, _ = await start(engine.rank.settings, "127.0.0.1:0", engine=engine)
        try:
            async with create_channel(f"127.0.0.1:{port}") as channel:
                ctx = SimpleNamespace(run_dir=tmp_path, trainer=GuardedTrainer(
                    trainer_pb2_grpc.TrainerStub(channel), f"127.0.0.1:{port}"))
                store = MemoryStore()
                for step in (1, 2):
                    await store.append_metrics("r", {"step": step, "data_position": 2.0 * step})
                record = RunRecord("r", "", checkpoint_path=str(newest), checkpoint_step=2, checkpoint_data_position=4)
                _, step, position, note = await checkpoints.restore_latest(store, record, ctx)
                shutil.rmtree(tmp_path / "checkpoints" / "step_1")
                with pytest.raises(CheckpointFailed) as none_left:
                    await checkpoints.restore_latest(store, RunRecord("r", "", checkpoint_path=str(newest),
                                                                      checkpoint_step=2), ctx)
                return (step, position, note, record.checkpoint_path, record.checkpoint_step), str(none_left.value)
        finally:
            await mesh.stop(0)

    with caplog.at_level("WARNING", logger="meshrl.runs"):
        fell_back, none_left = asyncio.run(main())
    first = str(tmp_path / "checkpoints" / "step_1")
    assert fell_back == (1, 2, f"; {newest} was refused: {refusal}", first, 1)
    assert f"run r: fell back from checkpoint {newest} to {first} (step 1)" in caplog.messages
    assert none_left == refusal
