"""Sender side of the UpdateWeights stream: a manifest message, then CRC-checked payload buckets."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import AsyncIterator, Iterator, Mapping

import torch

from meshrl.v1 import common_pb2
from services.common.tensors.weights import DEFAULT_BUCKET_BYTES, build_manifest, iter_buckets
from services.rollout.convert import manifest_to_pb


def weight_messages(state: Mapping[str, torch.Tensor], version: int,
                    bucket_bytes: int = DEFAULT_BUCKET_BYTES, *, adapter: str = "", adapter_config: dict | None = None,
                    base_id: str = "") -> Iterator[common_pb2.WeightBucket]:
    """The WeightBucket messages of one update: manifest first, the payload slices in order, the commit. adapter:
    the update is that LoRA adapter (PEFT's saved names; adapter_config: r, lora_alpha, target_modules) over the
    base `base_id` (the replica's GetInfo base_id)."""
    manifest = replace(build_manifest(state, version), adapter=adapter,
                       adapter_config=json.dumps(adapter_config) if adapter else "", base_id=base_id)
    yield common_pb2.WeightBucket(manifest=manifest_to_pb(manifest))
    for data, crc in iter_buckets(state, bucket_bytes):
        yield common_pb2.WeightBucket(data=data, crc32=crc)
    yield common_pb2.WeightBucket(commit=True)


async def _aiter(messages: Iterator[common_pb2.WeightBucket]) -> AsyncIterator[common_pb2.WeightBucket]:
    for m in messages:
        yield m


async def push_weights(stub, state_dict: Mapping[str, torch.Tensor], version: int,
                       bucket_bytes: int = DEFAULT_BUCKET_BYTES, *, timeout: float | None = None, **adapter):
    """Streams `state_dict` to a Rollout stub as weight version `version`; returns UpdateWeightsResponse.
    adapter: weight_messages' adapter, adapter_config and base_id (an adapter update).

    Buckets are built lazily, so the payload is never held in one buffer on the sending side.
    """
    return await stub.UpdateWeights(_aiter(weight_messages(state_dict, version, bucket_bytes, **adapter)),
                                    timeout=timeout)
