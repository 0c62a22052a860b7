"""The training API's calls to the mesh: the trainer (ForwardBackward, OptimStep, ConfigureRun, checkpoints,
PushWeights) and the rollout replicas (Generate). The engine's gRPC edge; an upstream error keeps its status."""

from __future__ import annotations

import asyncio
import functools

import grpc

from meshrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from services.common.errors import MeshError
from services.common.rpc.channel import create_channel
from services.common.rpc.pools import resolve_dns
from services.training_api.types import SampledSequence, SampleResponse


class Upstream(MeshError):
    """A call to the trainer or a replica failed: its status and message reach the training API's caller."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status


def _upstream(fn):
    @functools.wraps(fn)
    async def call(self, *args, **kwargs):
        try:
            return await fn(self, *args, **kwargs)
        except grpc.aio.AioRpcError as e:
            details = e.details() or ""
            # The call's name once: the trainer's own messages often start with it already.
            said = details if details.startswith(f"{fn.__name__}:") else f"{fn.__name__}: {details}"
            raise Upstream(e.code().name, said) from None
    return call


class Mesh:
    """Stubs of the trainer and of every rollout replica (Sample spreads its prompts over them)."""

    def __init__(self, trainer: str, rollout: list[str], *, token: str | None, timeout: float,
                 rollout_dns: str | None = None):
        self.trainer_address, self.rollout_dns = trainer, rollout_dns
        self._token, self._timeout = token, timeout
        self._channels = [create_channel(trainer, token=token, timeout=timeout)]
        self.trainer = trainer_pb2_grpc.TrainerStub(self._channels[0])
        self.rollout_addresses: list[str] = []
        self.rollout: list[rollout_pb2_grpc.RolloutStub] = []
        self._set_rollout(list(rollout))

    def _set_rollout(self, addresses: list[str]) -> None:
        self.rollout_addresses = addresses
        self._channels[1:] = [create_channel(a, token=self._token, timeout=self._timeout) for a in addresses]
        self.rollout = [rollout_pb2_grpc.RolloutStub(c) for c in self._channels[1:]]

    async def refresh_rollout(self) -> bool:
        """Re-resolves `rollout.dns` into one address per replica; -> whether the replica set changed. One name
        dialled as is would reach one replica per channel, so the trainer could push to one replica while Sample
        generates on another: each replica is addressed by its own address instead."""
        if not self.rollout_dns:
            return False
        try:
            found = await asyncio.to_thread(resolve_dns, self.rollout_dns)
        except OSError as e:
            raise Upstream("UNAVAILABLE", f"rollout.dns: {self.rollout_dns!r} does not resolve ({e})") from None
        if found == self.rollout_addresses:
            return False
        for channel in self._channels[1:]:
            await channel.close()
        self._set_rollout(found)
        return True

    @_upstream
    async def trainer_info(self) -> common_pb2.ServiceInfo:
        return await self.trainer.GetInfo(common_pb2.GetInfoRequest())

    @_upstream
    async def start_fresh(self) -> trainer_pb2.ConfigureRunResponse:
        """The trainer's model-path weights (fresh adapters), optimizer state cleared; the lr is each OptimStep's."""
        return await self.trainer.ConfigureRun(trainer_pb2.ConfigureRunRequest(
            actor=trainer_pb2.OptimSettings(lr=1e-4, betas=[0.9, 0.95], eps=1e-12, lr_schedule="constant"),
            reset_schedule=True, start=trainer_pb2.RunStart()))

    @_upstream
    async def create_adapter(self, name: str) -> trainer_pb2.AdapterResponse:
        return await self.trainer.CreateAdapter(trainer_pb2.AdapterRequest(name=name))

    @_upstream
    async def delete_adapter(self, name: str) -> trainer_pb2.AdapterResponse:
        return await self.trainer.DeleteAdapter(trainer_pb2.AdapterRequest(name=name))

    @_upstream
    async def forward_backward(self, request: trainer_pb2.ForwardBackwardRequest, adapter: str = ""
                               ) -> trainer_pb2.ForwardBackwardResponse:
        """`request` as the client sent it, on `adapter` ("" = the trainer's weights) whatever it named."""
        ours = trainer_pb2.ForwardBackwardRequest()
        ours.CopyFrom(request)
        ours.adapter = adapter
        return await self.trainer.ForwardBackward(ours)

    @_upstream
    async def optim_step(self, adam: trainer_pb2.AdamParams, adapter: str = "") -> trainer_pb2.OptimStepResponse:
        return await self.trainer.OptimStep(trainer_pb2.OptimStepRequest(adam_params=adam, adapter=adapter))

    @_upstream
    async def save(self, path: str, adapter: str = "") -> trainer_pb2.CheckpointResponse:
        return await self.trainer.SaveCheckpoint(trainer_pb2.CheckpointRequest(path=path, adapter=adapter))

    @_upstream
    async def load(self, path: str, adapter: str = "") -> trainer_pb2.CheckpointResponse:
        return await self.trainer.LoadCheckpoint(trainer_pb2.CheckpointRequest(path=path, adapter=adapter))

    @_upstream
    async def push_weights(self, adapter: str = "") -> tuple[int, dict[str, str]]:
        """The trainer's weights (or named adapter `adapter`) onto every rollout replica; -> (the version they now
        hold, the adapter each serves it under: "" where it holds them merged, its engine serving no adapters)."""
        response = await self.trainer.PushWeights(trainer_pb2.PushWeightsRequest(targets=self.rollout_addresses,
                                                                                 adapter=adapter))
        failed = [f"{r.target}: {r.error}" for r in response.results if not r.ok]
        if failed:
            raise Upstream("UNAVAILABLE", f"push_weights: {'; '.join(failed)}")
        return response.weight_version, {r.target: r.adapter for r in response.results}

    @_upstream
    async def generate(self, prompts: list[list[int]], sampling: rollout_pb2.SamplingParams,
                       serves: dict[str, str] | None = None) -> list[SampleResponse]:
        """Every prompt's samples, the prompts split in contiguous shares over the replicas, in request order."""
        k = len(self.rollout)
        shares = [prompts[i * len(prompts) // k:(i + 1) * len(prompts) // k] for i in range(k)]
        calls = [stub.Generate(rollout_pb2.GenerateRequest(
            prompts=[rollout_pb2.Prompt(id=str(j), prompt_ids=p) for j, p in enumerate(share)],
            sampling=_under(sampling, (serves or {}).get(address, ""))))
            for stub, address, share in zip(self.rollout, self.rollout_addresses, shares) if share]
        out = []
        for response in await asyncio.gather(*calls):
            out += [SampleResponse([SampledSequence(list(s.response_ids), list(s.logprobs), s.finish_reason)
                                    for s in r.samples]) for r in response.responses]
        return out

    async def close(self) -> None:
        for c in self._channels:
            await c.close()


def _under(sampling: rollout_pb2.SamplingParams, adapter: str) -> rollout_pb2.SamplingParams:
    """`sampling` under `adapter` on one replica ("" = the weights it holds)."""
    ours = rollout_pb2.SamplingParams()
    ours.CopyFrom(sampling)
    ours.adapter = adapter
    return ours
