"""User code named in a config, `package.module:name` or `path/to/file.py:name`: the one loader services share (env
tools and environments, the rollout replica's agent programs)."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any


def load_object(path: str, key: str) -> Any:
    """`package.module:attr` or `path/to/file.py:attr`; errors name the config key and the value."""
    module_name, sep, attr = path.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{key}: {path!r} is not of the form 'package.module:name' or 'file.py:name'")
    try:
        if module_name.endswith(".py") or "/" in module_name:
            file = Path(module_name).expanduser().resolve()
            if not file.is_file():
                raise ValueError(f"{key}: file {module_name!r} does not exist")
            spec = importlib.util.spec_from_file_location(f"meshrl_user_{file.stem}_{abs(hash(file))}", file)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing; say so
        raise ValueError(f"{key}: importing {module_name!r} raised {type(e).__name__}: {e}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{key}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj
