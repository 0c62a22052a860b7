"""The manifest of a weight update (its version and every tensor's name, dtype, shape and place in the payload):
plain data that the protobuf converters build and read without torch (services/common/tensors/weights.py holds the
tensor side: building a manifest from tensors, buckets, assembling and applying)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class TensorMeta:
    """Name, dtype and shape of one tensor and where its bytes sit in the payload."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Manifest:
    """What a weight update holds: its version and every tensor, in payload order."""

    version: int
    tensors: tuple[TensorMeta, ...]
    total_bytes: int
    # "" = the whole model; else the LoRA adapter these tensors are (WeightManifest.adapter), with its config JSON.
    adapter: str = ""
    adapter_config: str = ""
    # The frozen base model the update belongs to (WeightManifest.base_id); "" = not said.
    base_id: str = ""


def manifest_from_kwargs(version: int, total_bytes: int, tensors: Iterable, *, adapter: str = "",
                         adapter_config: str = "", base_id: str = "") -> Manifest:
    return Manifest(int(version), tuple(TensorMeta(t.name, t.dtype, tuple(int(s) for s in t.shape), int(t.offset),
                                                   int(t.nbytes)) for t in tensors), int(total_bytes),
                    adapter=adapter, adapter_config=adapter_config, base_id=base_id)
