"""User code named in a config, `package.module:name` or `path/to/file.py:name`: the one loader services share (env
tools and environments, the rollout replica's agent programs) and the coordinator's checks before start-up."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

from services.common.config import did_you_mean


def split_path(path: str, key: str) -> tuple[str, str]:
    """`package.module:attr` -> (module, attr); a malformed path is refused under `key`."""
    module_name, sep, attr = path.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{key}: {path!r} is not of the form 'package.module:name' or 'file.py:name'")
    return module_name, attr


def load_module(module_name: str, key: str):
    """A module by dotted name, or a Python file (`rewards/x.py`, relative to the working directory)."""
    try:
        if module_name.endswith(".py") or "/" in module_name:
            file = Path(module_name).expanduser().resolve()
            if not file.is_file():
                raise ValueError(f"{key}: file {module_name!r} does not exist")
            spec = importlib.util.spec_from_file_location(f"meshrl_user_{file.stem}_{abs(hash(file))}", file)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        return importlib.import_module(module_name)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing; say so
        raise ValueError(f"{key}: importing {module_name!r} raised {type(e).__name__}: {e}") from None


def attribute(module: Any, attr: str, key: str, where: str) -> Any:
    """`module.attr` (dotted attrs walk nested objects); a missing one is refused under `key`, with the nearest
    public name of the module when one is close."""
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            near = did_you_mean(part, [n for n in dir(obj) if not n.startswith("_")], cutoff=0.6)
            raise ValueError(f"{key}: {where!r} has no attribute {attr!r}{near}")
        obj = getattr(obj, part)
    return obj


def load_object(path: str, key: str) -> Any:
    """`package.module:attr` or `path/to/file.py:attr`; errors name the config key and the value."""
    module_name, attr = split_path(path, key)
    return attribute(load_module(module_name, key), attr, key, module_name)
