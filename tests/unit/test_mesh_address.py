"""Where the CLI and Client() find the coordinator: --coordinator, then MESHRL_COORDINATOR, then the running mesh's
record (XDG_CACHE_HOME honoured), then 127.0.0.1:50050; a record whose mesh is gone is ignored with a note."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from coordinator import mesh_address


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("MESHRL_COORDINATOR", raising=False)
    return tmp_path


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_the_record_lives_under_xdg_cache_home(cache):
    path = mesh_address.write("127.0.0.1:4242", pid=os.getpid(), log_dir="logs", recipe="r.yaml")
    assert path == cache / "meshrl" / "mesh.json"
    assert json.loads(path.read_text())["coordinator"] == "127.0.0.1:4242"


def test_explicit_beats_the_environment_which_beats_the_record(cache, monkeypatch):
    mesh_address.write("127.0.0.1:4242", pid=os.getpid(), log_dir="logs", recipe="r.yaml")
    found = mesh_address.find_coordinator()
    assert found.address == "127.0.0.1:4242" and "mesh.json" in found.source
    monkeypatch.setenv("MESHRL_COORDINATOR", "10.0.0.1:1")
    assert mesh_address.find_coordinator().address == "10.0.0.1:1"
    assert mesh_address.find_coordinator("10.0.0.2:2") == mesh_address.Found("10.0.0.2:2", "--coordinator")


def test_a_record_whose_mesh_is_gone_is_ignored_with_one_note(cache, capsys):
    mesh_address.write("127.0.0.1:4242", pid=_dead_pid(), log_dir="logs", recipe="r.yaml")
    found = mesh_address.find_coordinator()
    assert found.address == mesh_address.FALLBACK and "no running mesh" in found.source
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is no longer running" in err[0] and "127.0.0.1:4242" in err[0]


def test_a_mesh_removes_only_its_own_record(cache):
    mesh_address.write("127.0.0.1:4242", pid=os.getpid(), log_dir="logs", recipe="r.yaml")
    mesh_address.remove(os.getpid() + 1)          # another mesh's exit: the record stays
    assert mesh_address.read() is not None
    mesh_address.remove(os.getpid())
    assert mesh_address.read() is None and not mesh_address.mesh_file().exists()


def test_the_cli_and_the_client_take_the_recorded_address(cache):
    from coordinator.cli.common import CONNECTION
    from coordinator.client import Client

    mesh_address.write("127.0.0.1:4242", pid=os.getpid(), log_dir="logs", recipe="r.yaml")
    with Client() as client:
        assert client.address == "127.0.0.1:4242"
    assert CONNECTION["coordinator"][1].default is None     # looked up when the command runs, not at import
