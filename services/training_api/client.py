"""The training API's Python client (docs/training_api.md), in Tinker's shape: `ServiceClient()` ->
`create_lora_training_client(base_model, rank)` -> `forward_backward`, `optim_step`, `sample`, `save_state`,
`load_state`, `get_tokenizer`. A loop written for Tinker's primitives ports by renaming its imports.

Each call returns a future (`.result()`), run in the order submitted (one worker thread), as Tinker's do; `*_async`
variants are coroutines. Light: grpcio, protobuf and the standard library only (tests/unit/test_light_client.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import grpc

from meshrl.v1 import common_pb2, trainer_pb2, training_pb2, training_pb2_grpc
from services.common.rpc.grpc_config import MAX_MESSAGE_BYTES, service_config
from services.trainer.types import AdamParams  # the trainer's own (stdlib only): one definition of its defaults
from services.training_api import convert
from services.training_api.types import SampledSequence, SampleResponse

ENV = "MESHRL_TRAINING_API"

__all__ = ["AdamParams", "Datum", "ModelInput", "SamplingParams", "ServiceClient", "TrainingClient",
           "SampleResponse", "SampledSequence", "ForwardBackwardOutput", "find_address"]


@dataclass
class ModelInput:
    """A token sequence (Tinker's ModelInput of one text chunk)."""

    tokens: list[int]

    @classmethod
    def from_ints(cls, tokens: Sequence[int]) -> "ModelInput":
        return cls([int(t) for t in tokens])

    def to_ints(self) -> list[int]:
        return list(self.tokens)

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass
class Datum:
    """One training sequence: position i of model_input predicts loss_fn_inputs["target_tokens"][i]. The other
    inputs are per position: "weights" (cross_entropy), "logprobs" and "advantages" (policy losses). Values may be
    lists or anything with `tolist()` (numpy, torch)."""

    model_input: ModelInput
    loss_fn_inputs: dict[str, Any]

    def to_pb(self) -> trainer_pb2.Datum:
        unknown = set(self.loss_fn_inputs) - {"target_tokens", "weights", "logprobs", "advantages"}
        if unknown:
            raise ValueError(f"loss_fn_inputs: unknown keys {sorted(unknown)} (target_tokens, weights, logprobs, "
                             f"advantages)")

        def values(key: str) -> list:
            v = self.loss_fn_inputs.get(key, [])
            v = v.tolist() if hasattr(v, "tolist") else v
            return list(v.to_ints()) if isinstance(v, ModelInput) else list(v)

        return trainer_pb2.Datum(model_input=self.model_input.to_ints(), target_tokens=values("target_tokens"),
                                 weights=values("weights"), logprobs=values("logprobs"),
                                 advantages=values("advantages"))


@dataclass
class SamplingParams:
    """How to sample: max_tokens (0: the replicas' rollout.max_tokens), temperature (0: greedy), top_p, stop
    strings, seed (0: unseeded)."""

    max_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int = 0


@dataclass
class ForwardBackwardOutput:
    """Per Datum {"logprobs": [...]} (each target token's log-prob before the update) and the call's metrics
    ("loss:sum", "num_tokens", ...)."""

    loss_fn_outputs: list[dict[str, list[float]]]
    metrics: dict[str, float]


def find_address(explicit: str | None = None) -> str:
    """An explicit address, else $MESHRL_TRAINING_API, else the one `meshrl mesh` recorded beside its coordinator
    ($XDG_CACHE_HOME/meshrl/mesh.json, else ~/.cache/meshrl/mesh.json)."""
    if explicit:
        return explicit
    if os.environ.get(ENV):
        return os.environ[ENV]
    mesh = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "meshrl" / "mesh.json"
    try:
        address = json.loads(mesh.read_text()).get("training", "")
    except (OSError, ValueError):
        address = ""
    if not address:
        raise ValueError(f"address: no training API given, ${ENV} unset and no mesh recorded in {mesh} "
                         f"(start one with `meshrl mesh RECIPE`)")
    return address


class ServiceClient:
    """A connection to the training API (`meshrl mesh` serves it beside the coordinator)."""

    def __init__(self, address: str | None = None, *, token: str | None = None, timeout: float = 600.0):
        self.address = find_address(address)
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.enable_retries", 1), ("grpc.service_config", service_config(round_robin=False))]
        self._channel = grpc.insecure_channel(self.address, options=options)
        self._stub = training_pb2_grpc.TrainingStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._timeout = timeout

    def call(self, method: str, request):
        return getattr(self._stub, method)(request, metadata=self._metadata, timeout=self._timeout)

    def create_lora_training_client(self, base_model: str, rank: int = 8) -> "TrainingClient":
        """Fresh adapters of `rank` on the mesh trainer's model (`rank` must be its actor.lora.rank; 0 for a
        trainer without LoRA, which trains every weight)."""
        info = self.call("CreateTrainingClient", training_pb2.CreateTrainingClientRequest(base_model=base_model,
                                                                                          rank=rank))
        return TrainingClient(self, convert.client_from_pb(info))

    def get_info(self) -> dict[str, str]:
        return dict(self.call("GetInfo", common_pb2.GetInfoRequest()).details)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class TrainingClient:
    """One training client: its calls run on the mesh in the order they are made."""

    def __init__(self, service: ServiceClient, info):
        self.service, self.info, self.client_id = service, info, info.client_id
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"training-{self.client_id}")

    def _submit(self, fn, *args) -> Future:
        return self._worker.submit(fn, *args)

    async def _wait(self, future: Future):
        return await asyncio.wrap_future(future)

    # ---- training ---------------------------------------------------------------------------------

    def forward_backward(self, data: Sequence[Datum], loss_fn: str = "cross_entropy",
                         loss_fn_config: dict[str, float] | None = None) -> Future:
        """Adds the gradient of the summed loss over `data` (cross_entropy, importance_sampling, ppo, cispo) to
        what earlier calls left; -> Future[ForwardBackwardOutput]."""
        inner = trainer_pb2.ForwardBackwardRequest(data=[d.to_pb() for d in data], loss_fn=loss_fn,
                                                   loss_fn_config=loss_fn_config or {})
        request = training_pb2.ClientForwardBackwardRequest(client_id=self.client_id, request=inner)

        def run() -> ForwardBackwardOutput:
            pb = self.service.call("ForwardBackward", request)
            return ForwardBackwardOutput([{"logprobs": list(o.logprobs)} for o in pb.outputs], dict(pb.metrics))
        return self._submit(run)

    def optim_step(self, adam_params: AdamParams) -> Future:
        """One AdamW step over the accumulated gradients; -> Future[dict of metrics, with step and weight_version]."""
        a = adam_params
        request = training_pb2.ClientOptimStepRequest(client_id=self.client_id, adam_params=trainer_pb2.AdamParams(
            learning_rate=a.learning_rate, beta1=a.beta1, beta2=a.beta2, eps=a.eps, weight_decay=a.weight_decay,
            grad_clip_norm=a.grad_clip_norm))

        def run() -> dict[str, float]:
            pb = self.service.call("OptimStep", request)
            return {**pb.metrics, "step": float(pb.step), "weight_version": float(pb.weight_version)}
        return self._submit(run)

    # ---- sampling ---------------------------------------------------------------------------------

    def sample(self, prompt: ModelInput, num_samples: int, sampling_params: SamplingParams) -> Future:
        """num_samples continuations of one prompt from the current weights; -> Future[SampleResponse]."""
        return self._submit(lambda: self._sample([prompt], num_samples, sampling_params)[0])

    def sample_batch(self, prompts: Sequence[ModelInput], num_samples: int, sampling_params: SamplingParams) -> Future:
        """sample over many prompts in one call (spread over the rollout replicas); -> Future[list[SampleResponse]]."""
        return self._submit(lambda: self._sample(list(prompts), num_samples, sampling_params))

    def _sample(self, prompts: list[ModelInput], n: int, p: SamplingParams) -> list[SampleResponse]:
        request = convert.sample_request_to_pb(self.client_id, [m.to_ints() for m in prompts], n,
                                               max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                                               stop=p.stop, seed=p.seed)
        return convert.samples_from_pb(self.service.call("Sample", request))

    # ---- state ------------------------------------------------------------------------------------

    def save_state(self, name: str) -> Future:
        """Weights and optimizer state under `name` (training_api.state_dir) or an absolute path; -> Future[path]."""
        request = training_pb2.StateRequest(client_id=self.client_id, path=name)
        return self._submit(lambda: convert.state_from_pb(self.service.call("SaveState", request)).path)

    def load_state(self, path: str) -> Future:
        """Restores a state save_state wrote (weights and optimizer state); -> Future[StateInfo] (path, step,
        weight_version)."""
        request = training_pb2.StateRequest(client_id=self.client_id, path=path)
        return self._submit(lambda: convert.state_from_pb(self.service.call("LoadState", request)))

    def get_tokenizer(self) -> "Tokenizer":
        return Tokenizer(self)

    def close(self) -> None:
        """Closes the client on the service (the trainer is free for the next one)."""
        self._worker.shutdown(wait=True)
        self.service.call("CloseTrainingClient", training_pb2.ClientRef(client_id=self.client_id))

    # ---- asyncio ----------------------------------------------------------------------------------

    async def forward_backward_async(self, *args, **kwargs) -> ForwardBackwardOutput:
        return await self._wait(self.forward_backward(*args, **kwargs))

    async def optim_step_async(self, adam_params: AdamParams) -> dict[str, float]:
        return await self._wait(self.optim_step(adam_params))

    async def sample_async(self, prompt: ModelInput, num_samples: int, sampling_params: SamplingParams):
        return await self._wait(self.sample(prompt, num_samples, sampling_params))


class Tokenizer:
    """The base model's tokenizer, through the service (encode / decode); `hf()` builds the transformers tokenizer
    from its files where transformers is installed."""

    def __init__(self, client: TrainingClient):
        self._client = client
        pb = client.service.call("GetTokenizer", training_pb2.ClientRef(client_id=client.client_id))
        self.files = dict(pb.files)
        self.eos_token_id, self.bos_token_id, self.pad_token_id = pb.eos_token_id, pb.bos_token_id, pb.pad_token_id
        self.vocab_size = pb.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.encode_batch([text], add_special_tokens)[0]

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        pb = self._client.service.call("Encode", training_pb2.EncodeRequest(
            client_id=self._client.client_id, texts=list(texts), add_special_tokens=add_special_tokens))
        return [list(r.ids) for r in pb.results]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.decode_batch([ids], skip_special_tokens)[0]

    def decode_batch(self, ids: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        pb = self._client.service.call("Decode", training_pb2.DecodeRequest(
            client_id=self._client.client_id, ids=[training_pb2.TokenIds(ids=list(i)) for i in ids],
            skip_special_tokens=skip_special_tokens))
        return list(pb.texts)

    def hf(self):
        """transformers' tokenizer built from the files (needs transformers)."""
        from transformers import AutoTokenizer

        folder = tempfile.mkdtemp(prefix="meshrl-tokenizer-")
        for name, data in self.files.items():
            Path(folder, name).write_bytes(data)
        return AutoTokenizer.from_pretrained(folder)

