"""Scripts run in a fresh Python under Triton's CPU interpreter (TRITON_INTERPRET is read when the kernels are
decorated, so a test process that imported them already cannot switch): the Triton kernels' CPU tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_interpreted(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -c script args...` from the repository root with the interpreter on; output captured."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{REPO}:{REPO / 'protos'}"}
    return subprocess.run([sys.executable, "-c", script, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def assert_printed_ok(r: subprocess.CompletedProcess) -> None:
    """The script ran to its `print("ok")`; a Triton without a CPU interpreter skips the test."""
    if "ok" not in r.stdout and ("interpret" in r.stderr.lower() and "not supported" in r.stderr.lower()):
        pytest.skip(f"this Triton has no CPU interpreter: {r.stderr[-300:]}")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
