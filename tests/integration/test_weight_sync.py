"""Weight sync over the grpc transport: a real trainer pushing to real rollout replicas on port 0.

Three replicas end each sync on the trainer's version with its log-probs; a replica process killed
with SIGKILL mid-sync fails alone; a corrupted bucket is rejected and the old version stays. The
bucket codec the transport uses instead of protobuf is checked against protobuf itself.

`python -m tests.integration.test_weight_sync MODEL_DIR` runs the slow replica the kill test kills.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import zlib
from pathlib import Path

import grpc
import pytest
import torch

from meshrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from services.common.rpc.channel import create_channel
from services.common.config import load_config
from services.common.tensors.weight_transport import COMMIT_MESSAGE, DataBucket, HostPayload, decode_bucket, encode_bucket
from services.common.tensors.weights import iter_buckets
from services.trainer import convert
from services.trainer.testing import random_samples
from services.trainer.types import ActorLoss

REPO = Path(__file__).resolve().parents[2]
TOKEN = "s3cret"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from services.rollout.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("weight_sync_model"))


def sequences_pb(samples) -> common_pb2.LogProbsRequest:
    return common_pb2.LogProbsRequest(sequences=[
        common_pb2.TokenSequence(id=f"s{i}", prompt_ids=s.prompt_ids, response_ids=s.response_ids)
        for i, s in enumerate(samples)], temperature=1.0)


@contextlib.asynccontextmanager
async def trainer_and_replicas(model_dir: str, num_replicas: int):
    from services.rollout.config import RolloutSettings
    from services.rollout.servicer import start as start_rollout
    from services.trainer.config import TrainerSettings
    from services.trainer.servicer import start as start_trainer

    replicas = []
    settings = load_config(TrainerSettings, data={"model": {"path": model_dir}, "actor": {"lr": 1e-3},
                                                   "server": {"auth_token": TOKEN}})
    mesh, port, engine = await start_trainer(settings, "127.0.0.1:0")
    channel = create_channel(f"127.0.0.1:{port}", token=TOKEN)
    try:
        for _ in range(num_replicas):
            rs = RolloutSettings(model={"path": model_dir}, server={"auth_token": TOKEN})
            replicas.append(await start_rollout(rs, "127.0.0.1:0"))
        yield trainer_pb2_grpc.TrainerStub(channel), [f"127.0.0.1:{p}" for _, p, _ in replicas]
    finally:
        for m, _, replica in replicas:
            await m.stop(0)
            await replica.close()
        await channel.close()
        await mesh.stop(0)
        engine.close()


async def train_once(stub, samples) -> None:
    lp = await stub.ComputeLogProbs(sequences_pb(samples))
    for s, r in zip(samples, lp.results):
        s.old_logprobs = list(r.logprobs)
    await stub.TrainActor(convert.train_actor_to_pb(samples, ActorLoss()))


async def served(target: str, samples) -> tuple[int, list[list[float]], int]:
    """A replica's version (GetInfo), its log-probs of the samples, and the version a new sample carries."""
    async with create_channel(target, token=TOKEN) as ch:
        stub = rollout_pb2_grpc.RolloutStub(ch)
        info = await stub.GetInfo(common_pb2.GetInfoRequest())
        lp = await stub.ComputeLogProbs(sequences_pb(samples))
        gen = await stub.Generate(rollout_pb2.GenerateRequest(
            prompts=[rollout_pb2.Prompt(id="p", prompt_ids=samples[0].prompt_ids)],
            sampling=rollout_pb2.SamplingParams(n=1, max_tokens=2, temperature=1.0)))
        return info.weight_version, [list(r.logprobs) for r in lp.results], \
            gen.responses[0].samples[0].weight_version


def assert_parity(got: list[list[float]], want: list[list[float]]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, abs=1e-5)


@pytest.mark.slow
def test_three_replicas_end_every_sync_on_the_trainers_version_and_logprobs(model_dir):
    samples = random_samples(4, vocab_size=32)

    async def main():
        rounds = []
        async with trainer_and_replicas(model_dir, 3) as (stub, targets):
            info = await stub.GetInfo(common_pb2.GetInfoRequest())
            before = [await served(t, samples) for t in targets]
            # Three rounds: the first two updates land in fresh buffers, the third in the spare one.
            for _ in range(3):
                await train_once(stub, samples)
                pushed = await stub.PushWeights(trainer_pb2.PushWeightsRequest(targets=targets, bucket_bytes=8192))
                want = [list(r.logprobs) for r in (await stub.ComputeLogProbs(sequences_pb(samples))).results]
                rounds.append((pushed, want, [await served(t, samples) for t in targets]))
            after = await stub.GetInfo(common_pb2.GetInfoRequest())
            return info, after, targets, before, rounds

    info, after, targets, before, rounds = asyncio.run(main())
    # the default, auto, takes grpc to every replica of a CPU trainer, and says so per replica
    assert info.details["weight_transport"] == "auto"
    resolved = json.loads(after.details["resolved"])
    assert {k: v["value"] for k, v in resolved.items() if k.startswith("weight_sync.transport[")} == \
        {f"weight_sync.transport[{t}]": "grpc" for t in targets}
    assert {b[0] for b in before} == {0}
    for version, (pushed, want, replicas) in enumerate(rounds, start=1):
        assert pushed.weight_version == version
        assert [r.ok for r in pushed.results] == [True, True, True], [r.error for r in pushed.results]
        for replica_version, logprobs, sample_version in replicas:
            assert replica_version == version and sample_version == version
            assert_parity(logprobs, want)
        assert replicas[0][1] != before[0][1]          # the weights did change


def _slow_replica_main(model_dir: str) -> None:
    """A rollout replica that stops in the middle of a weight update, until the test kills it there."""
    from services.rollout.config import RolloutSettings
    from services.rollout.engine_torch.engine import TorchEngine
    from services.rollout.servicer import start

    class StuckEngine(TorchEngine):
        async def update_weights(self, manifest, buckets):
            async def slow():
                i = 0
                async for item in buckets:
                    i += 1
                    if i == 3:
                        print("receiving", flush=True)
                        await asyncio.Event().wait()      # held mid-stream, never by a clock
                    yield item
            return await super().update_weights(manifest, slow())

    async def main():
        settings = RolloutSettings(model={"path": model_dir}, server={"auth_token": TOKEN})
        mesh, port, _ = await start(settings, "127.0.0.1:0", engine=StuckEngine(settings))
        print(f"port {port}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


@pytest.mark.slow
def test_a_replica_killed_mid_sync_fails_alone_and_the_others_take_the_version(model_dir):
    samples = random_samples(4, vocab_size=32)
    proc = subprocess.Popen([sys.executable, "-m", "tests.integration.test_weight_sync", model_dir], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'protos'}"})
    try:
        line = proc.stdout.readline()
        assert line.startswith("port "), line
        slow = f"127.0.0.1:{int(line.split()[1])}"

        async def main():
            async with trainer_and_replicas(model_dir, 2) as (stub, targets):
                await train_once(stub, samples)
                # ~60 buckets of 4 KiB: the slow replica holds the third one until it is killed.
                push = asyncio.ensure_future(stub.PushWeights(trainer_pb2.PushWeightsRequest(
                    targets=[targets[0], slow, targets[1]], bucket_bytes=4096)))
                assert await asyncio.to_thread(proc.stdout.readline) == "receiving\n"
                os.kill(proc.pid, signal.SIGKILL)
                pushed = await push
                want = [list(r.logprobs) for r in (await stub.ComputeLogProbs(sequences_pb(samples))).results]
                return pushed, want, [await served(t, samples) for t in targets]

        pushed, want, replicas = asyncio.run(main())
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    ok = {r.target: r.ok for r in pushed.results}
    assert ok == {pushed.results[0].target: True, slow: False, pushed.results[2].target: True}
    assert pushed.results[1].error                 # the dead one is reported, not hidden
    assert "deadline" not in pushed.results[1].error.lower(), pushed.results[1].error   # the loss was seen, not waited out
    for version, logprobs, _ in replicas:
        assert version == 1
        assert_parity(logprobs, want)


@pytest.mark.slow
def test_a_corrupted_bucket_from_the_trainers_codec_is_rejected_and_a_clean_retry_lands(model_dir):
    from services.common.tensors.modeling import load_causal_lm
    from services.rollout.testing import random_state_like

    samples = random_samples(2, vocab_size=32)

    async def main():
        async with trainer_and_replicas(model_dir, 1) as (_, targets):
            async with create_channel(targets[0], token=TOKEN) as ch:
                model = load_causal_lm(model_dir)
                payload = HostPayload(random_state_like(model, seed=3), 5, 2048)
                manifest = common_pb2.WeightBucket(manifest=convert.manifest_to_pb(payload.manifest))
                good = [await payload.crc(i) for i in range(len(payload.buckets))]
                bad = list(good)
                bad[4] ^= 1
                # The RPC with bytes in, exactly as the trainer's GrpcSender sends them.
                call = ch.stream_unary("/meshrl.v1.Rollout/UpdateWeights", request_serializer=None,
                                       response_deserializer=common_pb2.UpdateWeightsResponse.FromString)

                async def stream(crcs):
                    yield manifest.SerializeToString()
                    for parts, crc in zip(payload.buckets, crcs):
                        yield encode_bucket(parts, crc)
                    yield COMMIT_MESSAGE

                before = await served(targets[0], samples)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call(stream(bad))
                after_bad = await served(targets[0], samples)
                done = await call(stream(good))
                payload.close()
                return before, err.value, after_bad, done, await served(targets[0], samples)

    before, err, after_bad, done, after = asyncio.run(main())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "bucket 4: checksum mismatch" in err.details()
    assert after_bad[:2] == before[:2] and after_bad[0] == 0          # old version, same log-probs
    assert done.weight_version == 5 and after[0] == 5 and after[1] != before[1]


def test_the_bucket_codec_agrees_with_protobuf_and_the_payload_with_iter_buckets():
    g = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(1000, generator=g), "b": torch.randn(7, 3, generator=g).to(torch.bfloat16),
             "c": torch.arange(5000, dtype=torch.int64), "empty": torch.zeros(0)}
    payload = HostPayload(state, 3, 3000)
    reference = list(iter_buckets(state, 3000))
    ours = [(b"".join(parts), zlib.crc32(b"".join(parts))) for parts in payload.buckets]
    assert ours == reference
    assert [asyncio.run(payload.crc(i)) for i in range(len(reference))] == [c for _, c in reference]
    payload.close()
    for data, crc in reference + [(b"", 0), (b"x", 2**32 - 1)]:
        wire = encode_bucket([memoryview(data)], crc)
        pb = common_pb2.WeightBucket.FromString(wire)
        assert (pb.data, pb.crc32) == (data, crc)
        back = decode_bucket(pb.SerializeToString())
        assert isinstance(back, DataBucket) and (bytes(back.data), back.crc32) == (data, crc)
    manifest = common_pb2.WeightBucket(manifest=common_pb2.WeightManifest(version=1, total_bytes=4))
    assert decode_bucket(manifest.SerializeToString()).HasField("manifest")
    device = common_pb2.WeightBucket(device=common_pb2.DeviceBucket(offset=0, nbytes=4, checksum=9))
    assert decode_bucket(device.SerializeToString()).device.checksum == 9
    assert COMMIT_MESSAGE == common_pb2.WeightBucket(commit=True).SerializeToString()
    commit = decode_bucket(COMMIT_MESSAGE)
    assert commit.commit and not commit.HasField("manifest") and not commit.data
    assert not decode_bucket(encode_bucket([memoryview(b"xy")], 5)).commit
    with pytest.raises(Exception):
        decode_bucket(b"\x12\xff\xff\xff\xff\x0f")         # a data field longer than the message


def test_a_grpc_update_with_a_device_bucket_or_a_short_payload_is_invalid_argument(model_dir):
    from services.rollout.config import RolloutSettings
    from services.rollout.servicer import start

    async def main():
        mesh, port, replica = await start(RolloutSettings(model={"path": model_dir}), "127.0.0.1:0")
        try:
            async with create_channel(f"127.0.0.1:{port}") as ch:
                stub = rollout_pb2_grpc.RolloutStub(ch)
                from services.rollout.testing import random_state_like
                payload = HostPayload(random_state_like(replica.engine.model, seed=1), 2, 4096)
                manifest = common_pb2.WeightBucket(manifest=convert.manifest_to_pb(payload.manifest))
                errors = []
                for tail in ([common_pb2.WeightBucket(device=common_pb2.DeviceBucket(offset=0, nbytes=4))],
                             [common_pb2.WeightBucket(data=bytes(payload.buckets[0][0]),
                                                      crc32=zlib.crc32(payload.buckets[0][0])),
                              common_pb2.WeightBucket(commit=True)]):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await stub.UpdateWeights(iter([manifest, *tail]))
                    errors.append((err.value.code(), err.value.details()))
                # A device transport on a CPU replica is refused naming the fix.
                ipc = common_pb2.WeightBucket(manifest=convert.manifest_to_pb(payload.manifest))
                ipc.manifest.transport = "ipc"
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.UpdateWeights(iter([ipc]))
                errors.append((err.value.code(), err.value.details()))
                info = await stub.GetInfo(common_pb2.GetInfoRequest())
                payload.close()
                return errors, info
        finally:
            await mesh.stop(0)
            await replica.close()

    errors, info = asyncio.run(main())
    assert errors[0][0] == grpc.StatusCode.INVALID_ARGUMENT and "device bucket in a grpc update" in errors[0][1]
    assert errors[1][0] == grpc.StatusCode.INVALID_ARGUMENT and "payload truncated" in errors[1][1]
    assert errors[2][0] == grpc.StatusCode.FAILED_PRECONDITION and "use transport grpc" in errors[2][1]
    assert info.weight_version == 0 and info.details["weight_transports"] == "grpc"


if __name__ == "__main__":
    _slow_replica_main(sys.argv[1])


@pytest.mark.slow
def test_a_push_the_replica_answers_unavailable_is_sent_again_once_whole(model_dir):
    """The grpc stream goes without gRPC's retry buffer (GrpcSender.max_attempts = 1), so the sender itself sends
    a stream that met UNAVAILABLE again, whole, on a fresh channel; a second UNAVAILABLE fails the replica."""
    from services.common.errors import Unavailable
    from services.rollout.config import RolloutSettings
    from services.rollout.engine_torch.engine import TorchEngine
    from services.rollout.servicer import start as start_rollout

    samples = random_samples(4, vocab_size=32)

    class Flaky(TorchEngine):
        refusals = 1
        calls = 0

        async def update_weights(self, manifest, buckets):
            Flaky.calls += 1
            received = [b async for b in buckets]          # the whole stream came in before the refusal
            if Flaky.refusals:
                Flaky.refusals -= 1
                raise Unavailable("replica restarting")

            async def again():
                for b in received:
                    yield b
            return await super().update_weights(manifest, again())

    async def main():
        async with trainer_and_replicas(model_dir, 1) as (stub, targets):
            rs = RolloutSettings(model={"path": model_dir}, server={"auth_token": TOKEN})
            server, port, engine = await start_rollout(rs, "127.0.0.1:0", engine=Flaky(rs))
            flaky = f"127.0.0.1:{port}"
            try:
                await train_once(stub, samples)
                once = await stub.PushWeights(trainer_pb2.PushWeightsRequest(targets=[flaky, targets[0]]))
                calls_once = Flaky.calls
                Flaky.refusals = 2
                await train_once(stub, samples)
                twice = await stub.PushWeights(trainer_pb2.PushWeightsRequest(targets=[flaky, targets[0]]))
                return once, calls_once, twice, Flaky.calls, await served(flaky, samples)
            finally:
                await server.stop(0)
                await engine.close()

    once, calls_once, twice, calls, (version, _, _) = asyncio.run(main())
    assert [r.ok for r in once.results] == [True, True], [r.error for r in once.results]
    assert calls_once == 2                             # refused once, sent again, applied
    assert [r.ok for r in twice.results] == [False, True]
    assert "UNAVAILABLE" in twice.results[0].error and calls == 4     # two refusals: no third attempt
    assert twice.weight_version == 2 and version == 1      # version 2 never landed on it
