"""The committed stubs are exactly what grpcio-tools generates from the .proto files."""

import filecmp
import subprocess
import sys
from pathlib import Path

import pytest

PROTOS = Path(__file__).resolve().parents[2] / "protos"


def test_generated_stubs_match_the_proto_files(tmp_path):
    pytest.importorskip("grpc_tools")
    protos = sorted(str(p.relative_to(PROTOS)) for p in (PROTOS / "meshrl" / "v1").glob("*.proto"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *protos], cwd=PROTOS, check=True)
    generated = sorted(p.name for p in (tmp_path / "meshrl" / "v1").iterdir())
    committed = sorted(p.name for p in (PROTOS / "meshrl" / "v1").iterdir() if p.suffix in (".py", ".pyi")
                       and p.name != "__init__.py")
    assert generated == committed
    stale = [name for name in generated
             if not filecmp.cmp(tmp_path / "meshrl" / "v1" / name, PROTOS / "meshrl" / "v1" / name, shallow=False)]
    assert not stale, f"stubs out of date, run `make protos`: {stale}"


def test_every_rpc_and_field_has_a_comment():
    for proto in (PROTOS / "meshrl" / "v1").glob("*.proto"):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip().startswith("rpc "):
                assert lines[i - 1].strip().startswith("//"), f"{proto.name}:{i + 1} rpc without a comment"


def test_every_field_has_a_comment():
    import re

    field = re.compile(r"^(repeated |optional |map<)?[\w.<>, ]+ \w+ = \d+;")
    for proto in (PROTOS / "meshrl" / "v1").glob("*.proto"):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            if field.match(line.strip()):
                assert lines[i - 1].strip().startswith("//"), f"{proto.name}:{i + 1} field without a comment"
