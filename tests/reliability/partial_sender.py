"""`python -m tests.reliability.partial_sender ADDRESS MODEL FRACTION`: streams other weights to a rollout
replica and SIGKILLs itself after FRACTION of the payload (1.0: every byte, but neither the commit message
nor the end of the stream; "complete": a normal, whole update)."""

import os
import signal
import sys
import time

import grpc
import torch

from meshrl.v1 import rollout_pb2_grpc
from services.common.tensors.modeling import load_causal_lm
from services.common.tensors.weights import named_weights
from services.rollout.weights_client import weight_messages

VERSION = 99


def perturbed_state(model_path: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = load_causal_lm(model_path, dtype="float32", device="cpu")
    return {k: (v.detach() + 0.05 * torch.randn_like(v)).contiguous() for k, v in named_weights(model).items()}


def main(address: str, model_path: str, fraction: str) -> None:
    messages = list(weight_messages(perturbed_state(model_path), VERSION, bucket_bytes=64 * 1024))
    manifest, buckets = messages[0], messages[1:-1]           # messages[-1]: the commit
    if fraction == "complete":
        with grpc.insecure_channel(address) as channel:
            reply = rollout_pb2_grpc.RolloutStub(channel).UpdateWeights(iter(messages), timeout=60)
        print(f"applied version {reply.weight_version}", flush=True)
        return
    cut = int(len(buckets) * float(fraction))

    def stream():
        yield manifest
        yield from buckets[:cut]
        print(f"sent {cut} of {len(buckets)} buckets", flush=True)
        time.sleep(1.0)                       # let the bytes reach the replica, then die mid-stream
        os.kill(os.getpid(), signal.SIGKILL)
        yield from buckets[cut:]              # never reached

    with grpc.insecure_channel(address) as channel:
        rollout_pb2_grpc.RolloutStub(channel).UpdateWeights(stream(), timeout=60)


if __name__ == "__main__":
    main(*sys.argv[1:4])
