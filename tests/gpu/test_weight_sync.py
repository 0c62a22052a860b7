"""GPU tests of the device weight transports: a trainer server in this process, rollout replicas as processes.

ipc: trainer and replica share cuda:0; after each push the replica serves the trainer's version and
log-probs, and a push takes milliseconds. nccl (two GPUs or more): the replica on cuda:1 joins the
trainer's group; a replica that stops answering fails the push and keeps its version, and the next push
forms a new group. nccl on three GPUs: replicas on cuda:1 and cuda:2 both get every push; a killed one is
left out and the other still gets the next version. Skipped without CUDA (nccl: without the GPUs or CuPy).

    PYTHONPATH=.:protos python -m pytest -q tests/gpu/test_weight_sync.py -s
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from meshrl.v1 import common_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from services.common.rpc.channel import create_channel
from services.common.config import load_config
from services.trainer import convert
from services.trainer.testing import random_samples, sequences_pb
from services.trainer.types import ActorLoss

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from services.rollout.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("weight_sync_gpu_model"), hidden_size=256, num_hidden_layers=4)


@contextlib.contextmanager
def replica_process(model_dir: str, device: str, tmp_path: Path):
    """`python -m services.rollout` on `device`, serving once GetInfo answers."""
    import grpc

    name = f"rollout-{device.replace(':', '')}"
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"path": model_dir, "device": device}}))
    log = open(tmp_path / f"{name}.log", "w")
    # Port 0: the replica binds a free port and says which in its "listening on" line.
    proc = subprocess.Popen([sys.executable, "-m", "services.rollout", "--config", str(cfg), "--port", "0"],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                [str(REPO), str(REPO / "protos"), os.environ.get("PYTHONPATH", "")])})
    try:
        for _ in range(360):                      # polls of the log, not a timing assertion
            listening = re.search(r"listening on [\w.:\[\]]+:(\d+)", Path(log.name).read_text())
            if listening or proc.poll() is not None:
                break
            time.sleep(0.5)
        if not listening:
            raise RuntimeError(f"replica on {device} did not start: {Path(log.name).read_text()}")
        address = f"127.0.0.1:{listening[1]}"
        with grpc.insecure_channel(address) as ch:
            rollout_pb2_grpc.RolloutStub(ch).GetInfo(common_pb2.GetInfoRequest(), timeout=30)
        yield proc, address
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait()
        log.close()


@contextlib.asynccontextmanager
async def trainer(model_dir: str, transport: str, **weight_sync):
    from services.trainer.config import TrainerSettings
    from services.trainer.servicer import start

    settings = load_config(TrainerSettings, data={"model": {"path": model_dir, "device": "cuda"}, "actor": {"lr": 1e-3},
                                                   "weight_sync": {"transport": transport, **weight_sync}})
    mesh, port, engine = await start(settings, "127.0.0.1:0")
    channel = create_channel(f"127.0.0.1:{port}")
    try:
        yield trainer_pb2_grpc.TrainerStub(channel), engine
    finally:
        await channel.close()
        await mesh.stop(0)
        engine.close()


async def train_and_push(stub, samples, targets):
    lp = await stub.ComputeLogProbs(sequences_pb(samples))
    for s, r in zip(samples, lp.results):
        s.old_logprobs = list(r.logprobs)
    await stub.TrainActor(convert.train_actor_to_pb(samples, ActorLoss()))
    pushed = await stub.PushWeights(trainer_pb2.PushWeightsRequest(targets=targets))
    want = [list(r.logprobs) for r in (await stub.ComputeLogProbs(sequences_pb(samples))).results]
    return pushed, want


async def served(target: str, samples):
    async with create_channel(target) as ch:
        stub = rollout_pb2_grpc.RolloutStub(ch)
        info = await stub.GetInfo(common_pb2.GetInfoRequest())
        lp = await stub.ComputeLogProbs(sequences_pb(samples))
        return info, [list(r.logprobs) for r in lp.results]


def assert_parity(got, want, tol=1e-4):
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, abs=tol)


def test_ipc_pushes_land_in_a_replica_process_on_the_same_gpu_with_the_trainers_logprobs(model_dir, tmp_path):
    samples = random_samples(4, vocab_size=32)
    with replica_process(model_dir, "cuda:0", tmp_path) as (_, target):
        async def main():
            rounds = []
            async with trainer(model_dir, "ipc") as (stub, _):
                for _ in range(3):
                    pushed, want = await train_and_push(stub, samples, [target])
                    rounds.append((pushed, want, await served(target, samples)))
            return rounds

        rounds = asyncio.run(main())
    for version, (pushed, want, (info, logprobs)) in enumerate(rounds, start=1):
        assert [r.ok for r in pushed.results] == [True], pushed.results[0].error
        assert pushed.weight_version == version and info.weight_version == version
        assert_parity(logprobs, want)
        print(f"ipc push {version}: {pushed.num_bytes} bytes, {pushed.results[0].seconds * 1e3:.1f} ms")
    assert "ipc" in rounds[0][2][0].details["weight_transports"]
    # That later pushes only copy on the device (handles opened once) is a speed: bench/weight_sync.py measures it
    # (`first_push_seconds` beside `all_seconds` in bench/results/weight_sync.json).
    assert all(r[0].results[0].seconds > 0 for r in rounds)


def _two_gpus_and_cupy(gpus: int = 2) -> str:
    if torch.cuda.device_count() < gpus:
        return f"needs {gpus} GPUs"
    try:
        import cupy.cuda.nccl  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"needs CuPy with NCCL ({e})"
    return ""


@pytest.mark.skipif(bool(_two_gpus_and_cupy()), reason=_two_gpus_and_cupy() or "ok")
def test_nccl_broadcast_reaches_a_replica_on_another_gpu_and_a_stalled_one_keeps_its_version(model_dir, tmp_path):
    samples = random_samples(4, vocab_size=32)
    with replica_process(model_dir, "cuda:1", tmp_path) as (proc, target):
        async def main():
            async with trainer(model_dir, "nccl", collective_timeout_s=20) as (stub, _):
                first, want1 = await train_and_push(stub, samples, [target])
                served1 = await served(target, samples)
                second, want2 = await train_and_push(stub, samples, [target])   # the same group, no re-forming
                os.kill(proc.pid, signal.SIGSTOP)                                # the replica stops answering
                stalled, _ = await train_and_push(stub, samples, [target])
                # The push came back while the replica was still stopped: the probe and collective deadlines
                # ended it, not the replica's return.
                stalled_state = Path(f"/proc/{proc.pid}/stat").read_text().split(") ")[1][0]
                os.kill(proc.pid, signal.SIGCONT)
                kept = await served(target, samples)
                again, want4 = await train_and_push(stub, samples, [target])     # a new group forms
                return (first, want1, served1, second, stalled, stalled_state, kept, want2, again, want4,
                        await served(target, samples))

        (first, want1, served1, second, stalled, stalled_state, kept, want2, again, want4,
         served4) = asyncio.run(main())
    assert first.results[0].ok, first.results[0].error
    assert served1[0].weight_version == 1
    assert_parity(served1[1], want1)
    assert second.results[0].ok and second.weight_version == 2
    assert not stalled.results[0].ok and stalled.results[0].error
    assert stalled_state == "T"                     # still stopped when the push returned
    assert kept[0].weight_version == 2                # the failed version 3 never landed
    assert_parity(kept[1], want2)
    assert again.results[0].ok, again.results[0].error
    assert served4[0].weight_version == 4
    assert_parity(served4[1], want4)


@pytest.mark.skipif(bool(_two_gpus_and_cupy(3)), reason=_two_gpus_and_cupy(3) or "ok")
def test_nccl_broadcast_reaches_two_replicas_and_a_killed_one_is_left_out_cleanly(model_dir, tmp_path):
    samples = random_samples(4, vocab_size=32)
    with replica_process(model_dir, "cuda:1", tmp_path) as (_, first_target), \
            replica_process(model_dir, "cuda:2", tmp_path) as (second, second_target):
        targets = [first_target, second_target]

        async def main():
            async with trainer(model_dir, "nccl", collective_timeout_s=20) as (stub, _):
                pushed, want = await train_and_push(stub, samples, targets)
                served_both = [await served(t, samples) for t in targets]
                second.kill()
                second.wait()
                after_kill, want_after = await train_and_push(stub, samples, targets)
                return pushed, want, served_both, after_kill, want_after, await served(first_target, samples)

        pushed, want, served_both, after_kill, want_after, survivor = asyncio.run(main())
    assert [r.ok for r in pushed.results] == [True, True], [r.error for r in pushed.results]
    for info, logprobs in served_both:
        assert info.weight_version == 1
        assert_parity(logprobs, want)
    # The killed replica fails its push with a reason; the group re-forms without it and the other gets version 2.
    by_target = {r.target: r for r in after_kill.results}
    assert not by_target[second_target].ok and "unreachable" in by_target[second_target].error
    assert by_target[first_target].ok, by_target[first_target].error
    assert survivor[0].weight_version == 2
    assert_parity(survivor[1], want_after)


def test_a_replica_in_the_trainers_process_reads_the_ipc_buffer_itself():
    """An in-process mesh (bench/many_runs.py on one GPU) pushes over ipc to a replica of its own process, which
    cannot open its own process's CUDA IPC handles ('invalid device context'): it reads the sender's buffer."""
    from services.rollout.weight_receivers import IpcReceiver
    from services.trainer.weights.ipc_sender import IpcSender

    buf = torch.arange(4096, device="cuda").to(torch.uint8)
    handle = IpcSender._share(buf, buf.device)
    src = IpcReceiver("cuda:0")._source(handle)
    assert src.data_ptr() == buf.data_ptr() and torch.equal(src[:buf.numel()], buf)


@pytest.mark.parametrize("bucket_bytes", [64, 1 << 20])
def test_staging_on_cuda_writes_the_bytes_and_checksums_of_the_per_tensor_path(bucket_bytes):
    """CUDA's foreach copy (its multi-tensor kernel, casts included) stages what the per-tensor path did, and
    cast_copies (foreach on CUDA only) snapshots what a .to() per tensor did."""
    from tests.unit.test_weight_transport_staging import (check_buffers_in_turn, check_cast_copies,
                                                          check_cast_folded_into_the_copy,
                                                          check_same_bytes_as_per_tensor)

    check_same_bytes_as_per_tensor("cuda", bucket_bytes)
    check_cast_copies("cuda")
    check_cast_folded_into_the_copy("cuda")
    check_buffers_in_turn("cuda")


def _recording_lora_replica(model_dir: str, *, max_loras: int):
    """A CUDA rollout engine serving LoRA adapters that records every adapter it loads: (name, version, a copy of
    its tensors)."""
    from services.rollout.config import RolloutSettings
    from services.rollout.engine_torch.engine import TorchEngine

    settings = RolloutSettings(model={"path": model_dir, "device": "cuda"},
                               rollout={"enable_lora": True, "max_loras": max_loras, "max_lora_rank": 8,
                                        "warmup": False})
    engine = TorchEngine(settings)
    loaded, load = [], engine.load_adapter

    def spy(name, version, cfg, tensors):
        loaded.append((name, version, {k: v.clone() for k, v in tensors.items()}))
        return load(name, version, cfg, tensors)

    engine.load_adapter = spy
    return settings, engine, loaded


def test_an_adapter_pushed_over_ipc_lands_in_a_replica_of_this_process_as_the_trainers_tensors(model_dir):
    """The trainer's float32 adapter, snapshot in bfloat16 as state_for_sync does (cast_copies), pushed twice over ipc
    with new values in between: each time the replica loads exactly the trainer's tensors (the kept staging views
    read the new values), under the push's version."""
    import json

    from services.common.base_identity import base_id
    from services.common.tensors.device_staging import cast_copies
    from services.rollout.servicer import start as start_rollout
    from services.trainer.weights.ipc_sender import IpcSender
    from services.trainer.weights.senders import ManifestTags
    from tests.unit.test_rollout_lora import trained_adapter

    master, config, _ = trained_adapter(model_dir, seed=3)
    master = {k: v.cuda() for k, v in master.items()}
    settings, engine, loaded = _recording_lora_replica(model_dir, max_loras=2)
    tags = ManifestTags(adapter="default", adapter_config=json.dumps(config), base_id=base_id(model_dir))

    async def main():
        mesh, port, replica = await start_rollout(settings, "127.0.0.1:0", engine=engine)
        target, sender, wants = f"127.0.0.1:{port}", IpcSender(), []
        try:
            for version in (1, 2):
                wants.append({k: v.to(torch.bfloat16) for k, v in master.items()})
                state = cast_copies(master, torch.bfloat16, "cuda")
                outcome = (await sender.push(state, version, [target], tags=tags))[0]
                assert outcome.ok, outcome.error
                for v in master.values():
                    v.mul_(-0.5)                      # the trainer steps: the next push carries new values
            async with create_channel(target) as ch:
                info = await rollout_pb2_grpc.RolloutStub(ch).GetInfo(common_pb2.GetInfoRequest())
            return wants, info
        finally:
            await sender.aclose()
            sender.close()
            await mesh.stop(0)
            await replica.close()

    wants, info = asyncio.run(main())
    assert [(name, version) for name, version, _ in loaded] == [("default", 1), ("default", 2)]
    for (_, _, got), want in zip(loaded, wants, strict=True):
        assert list(got) == list(want)
        for k, t in got.items():
            assert t.is_cuda and t.dtype == torch.bfloat16 and torch.equal(t, want[k]), k
    first = next(iter(wants[0]))
    assert not torch.equal(loaded[0][2][first], loaded[1][2][first])
    assert json.loads(info.details["adapters"]) == {"default": 2}


def test_adapters_pushed_at_once_over_ipc_each_land_as_their_own_tensors(model_dir):
    """Several runs push their adapters over ipc at the same moment (many runs on one mesh): the sender's staging
    buffers are shared, so each push must be read by the replica before the next one stages (else the replica reads
    another adapter's bytes: a checksum mismatch). Each adapter lands as its own trainer's tensors, every round."""
    import json

    from services.common.base_identity import base_id
    from services.common.tensors.device_staging import cast_copies
    from services.rollout.servicer import start as start_rollout
    from services.trainer.weights.ipc_sender import IpcSender
    from services.trainer.weights.senders import ManifestTags
    from tests.unit.test_rollout_lora import trained_adapter

    names = ["a", "b", "c", "d"]
    masters = {}
    for i, name in enumerate(names):
        master, config, _ = trained_adapter(model_dir, seed=10 + i)
        masters[name] = {k: v.cuda() for k, v in master.items()}
    settings, engine, loaded = _recording_lora_replica(model_dir, max_loras=4)

    async def main():
        mesh, port, replica = await start_rollout(settings, "127.0.0.1:0", engine=engine)
        target, sender = f"127.0.0.1:{port}", IpcSender()
        try:
            for version in (1, 2, 3):
                states = {n: cast_copies(m, torch.bfloat16, "cuda") for n, m in masters.items()}
                outcomes = await asyncio.gather(*(
                    sender.push(states[n], version, [target],
                                tags=ManifestTags(adapter=n, adapter_config=json.dumps(config),
                                                  base_id=base_id(model_dir))) for n in names))
                assert all(o[0].ok for o in outcomes), [o[0].error for o in outcomes]
                for m in masters.values():
                    for v in m.values():
                        v.mul_(-0.5)
        finally:
            await sender.aclose()
            sender.close()
            await mesh.stop(0)
            await replica.close()

    asyncio.run(main())
    assert sorted((n, v) for n, v, _ in loaded) == sorted((n, v) for n in names for v in (1, 2, 3))
    for name, version, got in loaded:
        # The masters were scaled by -0.5 after each of the 3 rounds (exact in floating point): back to this push's.
        scale = (-0.5) ** (version - 1 - 3)
        want = {k: (v * scale).to(torch.bfloat16) for k, v in masters[name].items()}
        for k, t in got.items():
            assert torch.equal(t, want[k]), (name, version, k)
