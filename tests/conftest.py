"""Shared test fixtures: the committed tiny model, thread limits, and a Redis check."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

# Unset, CPU torch step times vary 20x on 2-core machines.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
ARITH_MODEL = Path(os.environ.get("MESHRL_TEST_MODEL", REPO / "examples" / "arith" / "model"))


@pytest.fixture(scope="session")
def arith_model_path() -> str:
    """The committed tiny Qwen2 model and character tokenizer (loaded offline with from_pretrained)."""
    if not (ARITH_MODEL / "config.json").exists():
        pytest.fail(f"{ARITH_MODEL} is missing: run `python examples/arith/sft.py`")
    return str(ARITH_MODEL)


def redis_available(host: str = "127.0.0.1", port: int = 6379) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


@pytest.fixture
def redis_url() -> str:
    """A database other tests share: each test keeps its keys under its own `uuid` prefix and never clears
    keys it did not write (no `meshrl:*` sweeps)."""
    if not redis_available():
        pytest.skip("no Redis on 127.0.0.1:6379 (.ci/run starts one)")
    return "redis://127.0.0.1:6379/15"
