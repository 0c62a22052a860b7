"""A weight update whose sender is killed mid-stream never lands: the replica keeps its version and log-probs."""

import subprocess
import sys

import grpc
import pytest

from meshrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

from tests.reliability.procs import REPO, Procs, run_config, write_config

pytestmark = pytest.mark.slow

# prompt "1+2=" in the arith tokenizer's ids and an answer; any in-vocabulary ids do.
PROMPT, RESPONSE = [1, 5, 12, 6, 13], [7, 2]


def _state(stub) -> tuple[int, list[float]]:
    info = stub.GetInfo(common_pb2.GetInfoRequest(), timeout=30)
    reply = stub.ComputeLogProbs(common_pb2.LogProbsRequest(sequences=[
        common_pb2.TokenSequence(id="x", prompt_ids=PROMPT, response_ids=RESPONSE)]), timeout=30)
    return info.weight_version, list(reply.results[0].logprobs)


def _send(address: str, model: str, fraction: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tests.reliability.partial_sender", address, model, fraction],
                          cwd=REPO, capture_output=True, text=True, timeout=180)


def test_a_weight_update_whose_sender_dies_mid_stream_leaves_the_old_version_and_logprobs(arith_model_path,
                                                                                         tmp_path):
    path = write_config(tmp_path / "run.yaml", run_config(arith_model_path, tmp_path / "runs"))
    with Procs(path, tmp_path / "logs") as procs:
        replica = procs.start("rollout")
        with grpc.insecure_channel(replica.address) as channel:
            stub = rollout_pb2_grpc.RolloutStub(channel)
            before = _state(stub)
            assert before[0] == 0
            for fraction in ("0.5", "1.0"):
                sender = _send(replica.address, arith_model_path, fraction)
                assert sender.returncode == -9, sender.stderr[-2000:]      # killed, mid-stream
                assert "buckets" in sender.stdout
                assert _state(stub) == before, fraction                  # same version, same log-probs
            # The replica still serves, and a whole update does land (so the checks above could fail).
            reply = stub.Generate(rollout_pb2.GenerateRequest(
                prompts=[rollout_pb2.Prompt(id="p", prompt_ids=PROMPT)],
                sampling=rollout_pb2.SamplingParams(n=2, max_tokens=4, temperature=1.0)), timeout=60)
            assert len(reply.responses[0].samples) == 2
            assert _send(replica.address, arith_model_path, "complete").returncode == 0
            version, logprobs = _state(stub)
            assert version == 99 and logprobs != before[1]
        assert "Traceback" not in Procs.log(replica)
