"""The training API's client is light (grpcio, protobuf, the standard library) and speaks Tinker's shapes; Tinker's
loss names map onto the trainer's loss registry with their settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.trainer.policy_losses import policy_loss_settings
from services.trainer.types import PrimitiveLoss
from services.training_api.client import Datum, ModelInput, find_address

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "numpy", "pydantic", "opentelemetry")


def test_importing_the_training_client_loads_none_of_the_services_dependencies():
    code = ("import json, sys; import services.training_api.client; "
            f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "protos")])}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_adam_params_are_the_trainers_own_dataclass():
    from services.trainer import types
    from services.training_api import client
    assert client.AdamParams is types.AdamParams and client.AdamParams().beta2 == 0.95


def test_the_address_is_the_given_one_then_the_environment_then_the_mesh_file(tmp_path, monkeypatch):
    monkeypatch.delenv("MESHRL_TRAINING_API", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(ValueError, match="^address: no training API given"):
        find_address()
    (tmp_path / "meshrl").mkdir()
    (tmp_path / "meshrl" / "mesh.json").write_text(json.dumps({"coordinator": "h:1", "training": "h:2"}))
    assert find_address() == "h:2"
    monkeypatch.setenv("MESHRL_TRAINING_API", "h:3")
    assert find_address() == "h:3" and find_address("h:4") == "h:4"


def test_a_datum_goes_on_the_wire_as_given_and_an_unknown_input_is_refused_by_name():
    class Array(list):                               # numpy's and torch's tolist()
        def tolist(self):
            return list(self)

    pb = Datum(ModelInput.from_ints([1, 5, 6]), {"target_tokens": Array([5, 6, 7]), "weights": [0, 1, 1]}).to_pb()
    assert list(pb.model_input) == [1, 5, 6] and list(pb.target_tokens) == [5, 6, 7] and list(pb.weights) == [0, 1, 1]
    with pytest.raises(ValueError, match=r"^loss_fn_inputs: unknown keys \['mask'\]"):
        Datum(ModelInput.from_ints([1]), {"target_tokens": [2], "mask": [1]}).to_pb()


def test_tinker_loss_names_map_to_the_registry_with_their_settings():
    assert PrimitiveLoss("cross_entropy").policy_loss() == ("", {})
    assert PrimitiveLoss("importance_sampling").policy_loss() == ("importance_sampling", {})
    name, settings = PrimitiveLoss("ppo", {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}).policy_loss()
    checked = policy_loss_settings(name, settings, key="loss_fn")
    assert name == "vanilla" and checked.clip_ratio_low == pytest.approx(0.3)
    assert checked.clip_ratio_high == pytest.approx(0.3)
    assert checked.clip_ratio_c == 0.0                  # Tinker's ppo has no dual clip
    assert PrimitiveLoss("gspo", {"clip_ratio_low": 1e-3}).policy_loss() == ("gspo", {"clip_ratio_low": 1e-3})
    with pytest.raises(ValueError, match="^loss_fn_config: ppo takes clip_low_threshold and clip_high_threshold"):
        PrimitiveLoss("ppo", {"clip": 0.2}).policy_loss()
    with pytest.raises(ValueError, match=r"^loss_fn_config.clip_low_threshold: must be in \(0, 1\], got 1.5"):
        PrimitiveLoss("ppo", {"clip_low_threshold": 1.5}).policy_loss()
    with pytest.raises(ValueError, match="^loss_fn_config.clip_high_threshold: must be at least 1, got 0.9"):
        PrimitiveLoss("ppo", {"clip_high_threshold": 0.9}).policy_loss()
    with pytest.raises(ValueError, match="^loss_fn_config: cross_entropy takes no settings"):
        PrimitiveLoss("cross_entropy", {"x": 1.0}).policy_loss()
