"""Integration tests of the rollout service: a real gRPC server on port 0 around the torch engine."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import grpc
import pytest
import torch

from meshrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.common.rpc.channel import create_channel
from services.common.tensors.weights import iter_buckets
from services.rollout.config import RolloutSettings
from services.rollout.servicer import start
from services.rollout.testing import make_tiny_model, random_state_like
from services.rollout.weights_client import push_weights, weight_messages

REPO = Path(__file__).resolve().parents[2]
PROMPT = [4, 5, 13, 6, 15]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("rollout_service_model"))


@contextlib.asynccontextmanager
async def serving(model_dir: str, **rollout):
    settings = RolloutSettings(model={"path": model_dir}, rollout=rollout)
    mesh, port, replica = await start(settings, "127.0.0.1:0")
    channel = create_channel(f"127.0.0.1:{port}", timeout=60)
    try:
        yield rollout_pb2_grpc.RolloutStub(channel), replica.engine
    finally:
        await channel.close()
        await mesh.stop(0)
        await replica.close()


def greedy_request(prompt=PROMPT, **sampling) -> rollout_pb2.GenerateRequest:
    params = dict(n=1, temperature=0.0, max_tokens=8)
    params.update(sampling)
    return rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(id="q", prompt_ids=prompt)],
                                       sampling=rollout_pb2.SamplingParams(**params))


def logprobs_request(response_ids) -> common_pb2.LogProbsRequest:
    return common_pb2.LogProbsRequest(sequences=[common_pb2.TokenSequence(id="s", prompt_ids=PROMPT,
                                                                          response_ids=response_ids)])


def test_generate_returns_n_samples_per_prompt_with_logprobs_and_version(model_dir):
    async def main():
        async with serving(model_dir) as (stub, _):
            req = rollout_pb2.GenerateRequest(
                prompts=[rollout_pb2.Prompt(id="a", prompt_ids=PROMPT), rollout_pb2.Prompt(id="b", text="7-3=")],
                sampling=rollout_pb2.SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=9))
            return await stub.Generate(req)

    resp = asyncio.run(main())
    assert [r.prompt_id for r in resp.responses] == ["a", "b"]
    assert list(resp.responses[0].prompt_ids) == PROMPT
    assert list(resp.responses[1].prompt_ids) == [1, 10, 14, 6, 15]     # bos + one id per character
    for r in resp.responses:
        assert len(r.samples) == 3
        for s in r.samples:
            assert len(s.logprobs) == len(s.response_ids) >= 1
            assert all(lp <= 0 for lp in s.logprobs)
            assert s.finish_reason in ("stop", "length")
            assert s.weight_version == 0


def test_unset_sampling_fields_take_the_replica_defaults(model_dir):
    async def main():
        async with serving(model_dir, n=2, max_tokens=3) as (stub, _):
            return await stub.Generate(rollout_pb2.GenerateRequest(
                prompts=[rollout_pb2.Prompt(id="a", prompt_ids=PROMPT)],
                sampling=rollout_pb2.SamplingParams(temperature=0.0)))

    r = asyncio.run(main()).responses[0]
    assert len(r.samples) == 2
    assert all(len(s.response_ids) == 3 and s.finish_reason == "length" for s in r.samples)


def test_get_info_reports_role_model_version_and_limits(model_dir):
    async def main():
        async with serving(model_dir, max_batch_size=8) as (stub, _):
            return await stub.GetInfo(common_pb2.GetInfoRequest())

    info = asyncio.run(main())
    assert info.role == "rollout"
    assert info.model == model_dir
    assert info.weight_version == 0
    assert info.details["engine"] == "torch"
    assert info.details["max_model_len"] == "64"
    assert info.details["max_batch_size"] == "8"
    assert info.details["device"] == "cpu"
    assert info.details["dtype"] == "float32"


def test_update_weights_changes_logprobs_to_the_new_weights_and_bumps_the_version(model_dir):
    async def main():
        async with serving(model_dir) as (stub, engine):
            before = (await stub.Generate(greedy_request())).responses[0].samples[0]
            new = random_state_like(engine.model, seed=5)
            done = await push_weights(stub, new, version=7, bucket_bytes=3000)
            info = await stub.GetInfo(common_pb2.GetInfoRequest())
            old_seq = await stub.ComputeLogProbs(logprobs_request(before.response_ids))
            after = (await stub.Generate(greedy_request())).responses[0].samples[0]
            return before, new, done, info, old_seq, after

    before, new, done, info, old_seq, after = asyncio.run(main())
    assert done.weight_version == 7 and info.weight_version == 7
    assert done.num_bytes == sum(t.numel() * t.element_size() for t in new.values())
    assert done.seconds > 0
    assert after.weight_version == 7 and old_seq.weight_version == 7
    # A fresh model holding the pushed tensors gives the same log-probs the replica now reports.
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(model_dir)
    ref.load_state_dict(new, strict=False)
    ref.tie_weights()
    from services.common.tensors.modeling import batched_logprobs
    expected_old = batched_logprobs(ref, [PROMPT], [before.response_ids], pad_id=0)[0]
    expected_new = batched_logprobs(ref, [PROMPT], [after.response_ids], pad_id=0)[0]
    assert max(abs(a - b) for a, b in zip(old_seq.results[0].logprobs, expected_old)) < 1e-4
    assert max(abs(a - b) for a, b in zip(after.logprobs, expected_new)) < 1e-4
    assert max(abs(a - b) for a, b in zip(old_seq.results[0].logprobs, before.logprobs)) > 1e-3


async def _old_state(stub):
    info = await stub.GetInfo(common_pb2.GetInfoRequest())
    lp = await stub.ComputeLogProbs(logprobs_request([7, 8, 9]))
    return info.weight_version, list(lp.results[0].logprobs)


def test_a_corrupted_bucket_is_rejected_and_the_old_weights_stay(model_dir):
    async def main():
        async with serving(model_dir) as (stub, engine):
            old = await _old_state(stub)
            msgs = list(weight_messages(random_state_like(engine.model, seed=6), version=1, bucket_bytes=4096))
            msgs[3] = common_pb2.WeightBucket(data=msgs[3].data, crc32=msgs[3].crc32 ^ 0xFFFF)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.UpdateWeights(iter(msgs))
            return old, err.value, await _old_state(stub)

    old, err, now = asyncio.run(main())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "bucket 2: checksum mismatch" in err.details()     # message 3 is the third data bucket
    assert now == old and now[0] == 0


@pytest.mark.slow
def test_a_stream_rejected_early_reports_its_error_while_the_client_is_still_sending(model_dir):
    # The handler fails at message 1 with 2,000 more to come: the client gets the handler's INVALID_ARGUMENT, not
    # grpc.aio's INTERNAL ("Failed execute_batch") from a send that raced the server's end of the call. Without
    # the server reading the rest of the stream first, 1-2% of tries lost that race here (so ~85% of runs fail).
    async def main():
        async with serving(model_dir) as (stub, _):
            data = bytes(256)
            msgs = [common_pb2.WeightBucket(data=data, crc32=zlib.crc32(data)) for _ in range(2000)]
            errors = []
            for _ in range(100):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.UpdateWeights(iter(msgs))
                errors.append((err.value.code(), err.value.details()))
            return errors

    for code, details in asyncio.run(main()):
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "manifest" in details, (code, details)


def test_a_wrong_shape_tensor_is_rejected_naming_it_and_the_old_weights_stay(model_dir):
    async def main():
        async with serving(model_dir) as (stub, engine):
            old = await _old_state(stub)
            new = random_state_like(engine.model, seed=7)
            new["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(4, 4)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await push_weights(stub, new, version=2)
            return old, err.value, await _old_state(stub)

    old, err, now = asyncio.run(main())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "model.layers.0.self_attn.k_proj.weight" in err.details() and "shape" in err.details()
    assert now == old


def test_a_stream_without_a_manifest_is_rejected(model_dir):
    async def main():
        async with serving(model_dir) as (stub, engine):
            state = random_state_like(engine.model, seed=8)
            msgs = [common_pb2.WeightBucket(data=d, crc32=c) for d, c in iter_buckets(state)]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.UpdateWeights(iter(msgs))
            return err.value, await _old_state(stub)

    err, now = asyncio.run(main())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "manifest" in err.details()
    assert now[0] == 0


def test_an_update_is_applied_only_after_its_commit_message(model_dir):
    # Every byte and a clean half-close, but no commit: refused (a sender that died after its last byte
    # looks the same to the server). A message after the commit is refused too. The whole stream lands.
    async def main():
        async with serving(model_dir) as (stub, engine):
            old = await _old_state(stub)
            msgs = list(weight_messages(random_state_like(engine.model, seed=10), version=5, bucket_bytes=4096))
            assert msgs[-1].commit and not msgs[-2].commit
            errors = []
            for stream in (msgs[:-1], msgs + [msgs[-2]]):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.UpdateWeights(iter(stream))
                errors.append(err.value)
            kept = await _old_state(stub)
            reply = await stub.UpdateWeights(iter(msgs))
            return old, errors, kept, reply.weight_version

    old, errors, kept, version = asyncio.run(main())
    assert [e.code() for e in errors] == [grpc.StatusCode.INVALID_ARGUMENT] * 2
    assert "without its commit message" in errors[0].details()
    assert "follows the commit message" in errors[1].details()
    assert kept == old and version == 5


def test_a_client_that_disconnects_mid_stream_leaves_the_old_weights_and_the_server_usable(model_dir):
    async def main():
        async with serving(model_dir) as (stub, engine):
            old = await _old_state(stub)
            new = random_state_like(engine.model, seed=9)
            msgs = list(weight_messages(new, version=3, bucket_bytes=2048))
            hang, sent = asyncio.Event(), asyncio.Event()

            async def partial():
                for m in msgs[:4]:
                    yield m
                sent.set()                 # gRPC asked for a fifth message: the four are on their way
                await hang.wait()

            call = stub.UpdateWeights(partial())
            await asyncio.wait_for(sent.wait(), 30)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            mid = await _old_state(stub)
            done = await push_weights(stub, new, version=4)
            return old, mid, done

    old, mid, done = asyncio.run(main())
    assert mid == old
    assert done.weight_version == 4


def test_a_weight_swap_waits_for_running_generation_so_no_sample_mixes_versions(model_dir):
    async def main():
        async with serving(model_dir, max_batch_size=2) as (stub, engine):
            async def generate():
                return await stub.Generate(greedy_request(n=16, temperature=1.0, max_tokens=50))

            started = threading.Event()     # the generation runs, holding the engine lock
            generate_jobs = engine._generate_jobs

            def entered(*args, **kwargs):
                started.set()
                return generate_jobs(*args, **kwargs)

            engine._generate_jobs = entered
            long_gen = asyncio.create_task(generate())
            assert await asyncio.to_thread(started.wait, 60)
            await push_weights(stub, random_state_like(engine.model, seed=10), version=5)
            resp = await long_gen
            after = await stub.Generate(greedy_request())
            return resp, after

    resp, after = asyncio.run(main())
    samples = resp.responses[0].samples
    assert {s.weight_version for s in samples} == {0}
    # Every token came from the old weights: no step of the generation saw a half-swapped model.
    from services.common.tensors.modeling import batched_logprobs, load_causal_lm
    old = load_causal_lm(model_dir)
    expected = batched_logprobs(old, [PROMPT] * len(samples), [list(s.response_ids) for s in samples], pad_id=0)
    for s, e in zip(samples, expected):
        assert max(abs(a - b) for a, b in zip(s.logprobs, e)) < 1e-4
    assert after.responses[0].samples[0].weight_version == 5


@pytest.mark.parametrize("request_kwargs, field", [
    (dict(prompts=[]), "prompts: empty batch"),
    (dict(sampling=dict(n=-1)), "sampling.n"),
    (dict(sampling=dict(temperature=-0.5)), "sampling.temperature"),
    (dict(sampling=dict(top_p=2.0)), "sampling.top_p"),
    (dict(sampling=dict(max_tokens=-3)), "sampling.max_tokens"),
    (dict(prompts=[rollout_pb2.Prompt(id="x", prompt_ids=[1, 500])]), "prompts[0].prompt_ids"),
    (dict(prompts=[rollout_pb2.Prompt(id="x", prompt_ids=[4] * 80)]), "prompts[0]"),
    (dict(prompts=[rollout_pb2.Prompt(id="x")]), "prompts[0]: needs prompt_ids or text"),
])
def test_bad_generate_input_is_invalid_argument_naming_the_field_and_the_server_keeps_serving(
        model_dir, request_kwargs, field):
    async def main():
        async with serving(model_dir) as (stub, _):
            sampling = dict(n=1, temperature=1.0, max_tokens=4)
            sampling.update(request_kwargs.get("sampling", {}))
            prompts = request_kwargs.get("prompts", [rollout_pb2.Prompt(id="a", prompt_ids=PROMPT)])
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(rollout_pb2.GenerateRequest(prompts=prompts,
                                                                sampling=rollout_pb2.SamplingParams(**sampling)))
            ok = await stub.Generate(greedy_request())
            return err.value, ok

    err, ok = asyncio.run(main())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.details()
    assert len(ok.responses[0].samples[0].response_ids) == 8


def test_bad_logprobs_input_is_invalid_argument(model_dir):
    async def main():
        async with serving(model_dir) as (stub, _):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.ComputeLogProbs(logprobs_request([]))
            return err.value

    err = asyncio.run(main())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "response_ids: empty" in err.details()


@pytest.mark.slow
def test_the_module_entry_point_serves_a_replica_from_a_config_file(model_dir, tmp_path):
    cfg = tmp_path / "rollout.yaml"
    cfg.write_text(f"model:\n  path: {model_dir}\nrollout:\n  n: 2\n  max_tokens: 4\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}:{REPO / 'protos'}")
    proc = subprocess.Popen([sys.executable, "-m", "services.rollout", "--config", str(cfg), "--port", "0"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("meshrl rollout listening on 127.0.0.1:"), line
        port = int(line.rsplit(":", 1)[1])

        async def main():
            channel = create_channel(f"127.0.0.1:{port}", timeout=30)
            stub = rollout_pb2_grpc.RolloutStub(channel)
            resp = await stub.Generate(rollout_pb2.GenerateRequest(prompts=[rollout_pb2.Prompt(id="a", text="1+1=")]))
            await channel.close()
            return resp

        r = asyncio.run(main()).responses[0]
        assert len(r.samples) == 2 and all(len(s.response_ids) <= 4 for s in r.samples)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
