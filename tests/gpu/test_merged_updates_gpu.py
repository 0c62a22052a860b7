"""Several adapters' updates in one pass on CUDA (services/trainer/updates/merged.py, model/lora_mixed.py): the float32
tiny model's adapters end where each update alone takes them, as on the CPU (tests/unit/test_merged_updates.py).

    PYTHONPATH=.:protos python -m pytest -q tests/gpu/test_merged_updates_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from services.trainer.testing import make_tiny_model
from tests.unit.test_merged_updates import merged_equals_alone

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_merged_pass_equals_each_update_alone_on_cuda(tmp_path):
    merged_equals_alone(make_tiny_model(tmp_path / "m"), "cuda")
