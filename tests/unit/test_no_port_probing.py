"""No test or bench picks a port by probing: binding port 0, reading the port and closing the socket, then handing
the port to a server races with every other process on the machine (CI once failed with `Address already in use`).
Servers bind port 0 and announce the port; the few third-party ones that cannot go through tests/ports.py."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("tests", "bench")
# The helper names probing code goes by.
PROBE_NAMES = re.compile(r"\b_?(find_|get_|pick_)?(free|unused|open|spare)_port\b")


def _is_socket_call(node: ast.AST) -> bool:
    """socket.socket(...), socket(...) or socket.create_server(...)."""
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    return name in ("socket", "create_server")


def _binds_port_0(body: list[ast.stmt]) -> bool:
    for node in ast.walk(ast.Module(body=body, type_ignores=[])):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "bind" \
                and node.args and isinstance(node.args[0], ast.Tuple) and len(node.args[0].elts) == 2:
            port = node.args[0].elts[1]
            if isinstance(port, ast.Constant) and port.value == 0:
                return True
    return False


def _reads_port(stmt: ast.stmt) -> bool:
    """`return s.getsockname()[1]` or `port = s.getsockname()[1]`: the port read, and nothing done with it."""
    if not isinstance(stmt, (ast.Return, ast.Assign, ast.AnnAssign)) or stmt.value is None:
        return False
    calls = [n for n in ast.walk(stmt.value) if isinstance(n, ast.Call)]
    return bool(calls) and all(isinstance(c.func, ast.Attribute) and c.func.attr == "getsockname" for c in calls)


def probes(source: str) -> list[int]:
    """Lines of `with socket.socket() as s:` blocks that bind port 0 and end by reading the port: the port is
    used only after the socket is closed."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.With, ast.AsyncWith)) and any(_is_socket_call(i.context_expr) for i in node.items) \
                and _binds_port_0(node.body) and _reads_port(node.body[-1]):
            found.append(node.lineno)
    return found


def scanned_files() -> list[Path]:
    # Hidden folders are not ours: a bench's virtual environment (bench/.venv-trl) holds other projects' code.
    return sorted(p for d in SCANNED for p in (ROOT / d).rglob("*.py") if p != Path(__file__).resolve()
                  and not any(part.startswith(".") for part in p.relative_to(ROOT).parts))


def test_the_detector_finds_the_probing_pattern_and_passes_a_held_socket():
    probing = ("import socket\ndef free():\n    with socket.socket() as s:\n        s.bind(('127.0.0.1', 0))\n"
               "        return s.getsockname()[1]\n")
    assigned = "import socket\nwith socket.socket() as s:\n    s.bind(('', 0))\n    port = s.getsockname()[1]\n"
    held = ("import socket\nwith socket.socket() as s:\n    s.bind(('127.0.0.1', 0))\n    port = s.getsockname()[1]\n"
            "    check(port)\n")
    assert probes(probing) == [3] and probes(assigned) == [2] and probes(held) == []
    assert PROBE_NAMES.search("def _free_port():") and PROBE_NAMES.search("port = find_free_port()")
    assert not PROBE_NAMES.search("metrics_port = 0")


def test_no_test_or_bench_picks_a_port_by_probing():
    files = scanned_files()
    assert len(files) > 50 and any(p.name == "ports.py" for p in files)
    bad = []
    for path in files:
        text = path.read_text()
        bad += [f"{path.relative_to(ROOT)}:{line}: socket bound to port 0 and closed before its port is used"
                for line in probes(text)]
        bad += [f"{path.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}: {m.group(0)}"
                for m in PROBE_NAMES.finditer(text)]
    assert bad == [], "bind port 0 in the server and read its announced port (tests/ports.py for third-party " \
                      "servers):\n" + "\n".join(bad)
