"""Sender side of the UpdateWeights stream: a manifest message, then CRC-checked payload buckets."""

from __future__ import annotations

from typing import AsyncIterator, Iterator, Mapping

import torch

from meshrl.v1 import common_pb2
from services.common.tensors.weights import DEFAULT_BUCKET_BYTES, build_manifest, iter_buckets
from services.rollout.convert import manifest_to_pb


def weight_messages(state: Mapping[str, torch.Tensor], version: int,
                    bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[common_pb2.WeightBucket]:
    """The WeightBucket messages of one update: manifest first, the payload slices in order, the commit."""
    yield common_pb2.WeightBucket(manifest=manifest_to_pb(build_manifest(state, version)))
    for data, crc in iter_buckets(state, bucket_bytes):
        yield common_pb2.WeightBucket(data=data, crc32=crc)
    yield common_pb2.WeightBucket(commit=True)


async def _aiter(messages: Iterator[common_pb2.WeightBucket]) -> AsyncIterator[common_pb2.WeightBucket]:
    for m in messages:
        yield m


async def push_weights(stub, state_dict: Mapping[str, torch.Tensor], version: int,
                       bucket_bytes: int = DEFAULT_BUCKET_BYTES, *, timeout: float | None = None):
    """Streams `state_dict` to a Rollout stub as weight version `version`; returns UpdateWeightsResponse.

    Buckets are built lazily, so the payload is never held in one buffer on the sending side.
    """
    return await stub.UpdateWeights(_aiter(weight_messages(state_dict, version, bucket_bytes)), timeout=timeout)
