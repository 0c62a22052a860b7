"""Identity of a frozen base model (a digest of its folder), so a trainer pushing LoRA adapters knows whether a
rollout replica holds the same base: plain files and hashlib, no torch."""

from __future__ import annotations

import hashlib
import os
from functools import lru_cache
from pathlib import Path

# Bytes read per weight file: the safetensors header (every tensor's name, dtype, shape and offset) and evenly
# spaced blocks of the data. Two checkpoints of one architecture differ in almost every block, so a sampled digest
# tells them apart at start-up cost (reading gigabytes whole would take seconds per replica).
HEAD_BYTES = 1 << 20
BLOCKS = 16
BLOCK_BYTES = 1 << 16
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


@lru_cache(maxsize=16)
def base_id(path: str) -> str:
    """"sha256:<hex>" of model folder `path` (config.json and a sample of every weight file); "" when `path` is no
    local folder (a hub name: the identity is then unknown, and a LoRA run pushes the base once)."""
    folder = Path(path)
    if not folder.is_dir():
        return ""
    h = hashlib.sha256()
    config = folder / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    files = sorted(f for f in folder.iterdir() if f.is_file() and f.suffix in WEIGHT_SUFFIXES)
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(HEAD_BYTES))
            for i in range(BLOCKS):
                fh.seek(max(0, (size - BLOCK_BYTES) * i // max(1, BLOCKS - 1)), os.SEEK_SET)
                h.update(fh.read(BLOCK_BYTES))
    return f"sha256:{h.hexdigest()}" if files else ""
