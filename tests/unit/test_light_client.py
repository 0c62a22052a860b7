"""The run API's Python client is light: importing it loads no torch, transformers, numpy or pydantic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "numpy", "pydantic", "opentelemetry")


def test_importing_the_client_in_a_fresh_interpreter_loads_none_of_the_services_dependencies():
    code = ("import json, sys; import coordinator.client; "
            f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "protos")])}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_the_client_still_dumps_a_typed_run_config_with_its_secrets_in_clear():
    import yaml

    from coordinator.client import config_text
    from coordinator.runapi.runs import parse_run_config

    cfg = parse_run_config("server: {auth_token: s3cret}\nrollout: {n: 2, max_tokens: 6}\n")
    data = yaml.safe_load(config_text(cfg))
    assert data["server"]["auth_token"] == "s3cret" and data["rollout"]["n"] == 2


def test_every_service_face_imports_without_torch():
    """A face (config, types, convert) is what another service or a client reads: it needs no tensor library."""
    faces = sorted(f"services.{p.parent.name}.{p.stem}" for p in (REPO / "services").glob("*/*.py")
                   if p.stem in ("config", "types", "convert") and p.parent.name != "common")
    faces += ["services.reward.functions", "services.trainer.policy_losses"]
    code = ("import json, sys, importlib; "
            f"[importlib.import_module(m) for m in {faces!r}]; "
            "print(json.dumps(sorted(m for m in ('torch', 'transformers') if m in sys.modules)))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "protos")])}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    assert len(faces) >= 12 and json.loads(out.stdout) == []
