"""Where a running mesh's coordinator is: `meshrl mesh` records its address in a well-known file, and the CLI and
`Client()` look it up there when given no address. Standard library only: coordinator/client.py imports it.

Order: an explicit address, then the environment variable MESHRL_COORDINATOR, then the file
(`$XDG_CACHE_HOME/meshrl/mesh.json`, else `~/.cache/meshrl/mesh.json`), then 127.0.0.1:50050.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ENV = "MESHRL_COORDINATOR"
FALLBACK = "127.0.0.1:50050"


def mesh_file() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "meshrl" / "mesh.json"


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, ended but not yet waited for by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:     # someone else's process: it exists
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:             # no /proc (macOS): kill's answer stands
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def write(address: str, *, pid: int, log_dir: str, recipe: str, training: str = "") -> Path:
    """Records this mesh (atomically: a reader never sees half a file); the last mesh started wins. `training`: the
    training API's address (services/training_api/client.py reads it)."""
    path = mesh_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{pid}")
    tmp.write_text(json.dumps({"coordinator": address, "training": training, "pid": pid, "log_dir": log_dir,
                               "recipe": recipe,
                               "started": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def remove(pid: int) -> None:
    """Removes the file if it still records the mesh of `pid` (a mesh started later keeps its own)."""
    path = mesh_file()
    try:
        if json.loads(path.read_text()).get("pid") == pid:
            path.unlink()
    except (OSError, ValueError):
        pass


def read(note=lambda line: print(line, file=sys.stderr)) -> dict | None:
    """The recorded mesh, or None: no file, an unreadable one, or one whose mesh process is gone (with a note)."""
    path = mesh_file()
    try:
        data = json.loads(path.read_text())
        address, pid = data["coordinator"], int(data["pid"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        note(f"meshrl: ignoring {path}: not a mesh record")
        return None
    if not alive(pid):
        note(f"meshrl: ignoring {path}: its mesh (pid {pid}, coordinator {address}) is no longer running")
        return None
    return data


@dataclass(frozen=True)
class Found:
    """A coordinator address and where it came from (for messages: "from MESHRL_COORDINATOR")."""

    address: str
    source: str


def find_coordinator(explicit: str | None = None) -> Found:
    if explicit:
        return Found(explicit, "--coordinator")
    if os.environ.get(ENV):
        return Found(os.environ[ENV], ENV)
    mesh = read()
    if mesh is not None:
        return Found(mesh["coordinator"], f"the mesh recorded in {mesh_file()} (pid {mesh['pid']})")
    return Found(FALLBACK, f"the default (no --coordinator, no {ENV}, no running mesh in {mesh_file()})")
