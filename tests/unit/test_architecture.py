"""The import rules of docs/architecture.md, checked by walking the source tree's ASTs.

Layers, bottom to top: protos (`meshrl.v1`) < `services/common` < one service (`services/<role>`) <
`services/local.py` (every service in one process) < `coordinator` < `bench`. A service shows its face in
`config.py` (settings), `types.py` (request/result dataclasses, engine interface) and `convert.py` (those
dataclasses <-> protobuf); everything else in its folder is an implementation that only its own service loads.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("services", "coordinator", "examples", "bench")
FACES = {"config", "types", "convert"}
# The built-in reward rules are pure standard-library functions; the reward config checks a rule's name and
# params against them wherever it loads (meshrl up, StartRun), so they belong to the reward face.
# The policy losses' names and settings schemas likewise: the recipe's algorithm.policy_loss is checked against
# them before start, while the loss math (services/trainer/updates/policy_losses.py) stays behind the face.
EXTRA_FACES = {"services.reward.functions", "services.trainer.policy_losses"}
MAX_FILE_LINES = 600            # tests and benches
MAX_SOURCE_FILE_LINES = 450     # services, coordinator, examples
MAX_FUNCTION_LINES = 60
# Folders by concern, a dozen modules each (docs/architecture.md); the coordinator's subpackages keep to it.
MAX_FOLDER_MODULES = 15


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _python_files(top: str) -> list[Path]:
    """The project's own files under `top`: hidden folders (a bench's virtual environment) are not ours."""
    return [p for p in (ROOT / top).rglob("*.py") if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)]


def _source_modules() -> dict[str, Path]:
    return {_module_name(path): path for top in SOURCE_DIRS for path in _python_files(top)}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules `name` imports, at any depth of its AST (lazy imports inside functions count)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _source_modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _service(module: str) -> str | None:
    """`rollout` for `services.rollout.engine`; None outside a service folder."""
    parts = module.split(".")
    return parts[1] if parts[0] == "services" and len(parts) > 2 else None


def _is_face(module: str) -> bool:
    return module in EXTRA_FACES or (_service(module) not in (None, "common") and module.rpartition(".")[2] in FACES)


def test_the_import_graph_has_no_cycle(graph):
    assert _cycles(graph) == []


def test_nothing_under_services_imports_the_coordinator_or_bench(graph):
    bad = [f"{a} -> {b}" for a, bs in graph.items() if a.startswith("services")
           for b in bs if b.split(".")[0] in ("coordinator", "bench")]
    assert bad == []


def test_services_common_imports_no_service(graph):
    bad = [f"{a} -> {b}" for a, bs in graph.items() if _service(a) == "common"
           for b in bs if b.startswith("services") and _service(b) != "common" and b != "services"]
    assert bad == []


def test_a_service_reaches_another_service_only_through_its_face(graph):
    bad = [f"{a} -> {b}" for a, bs in graph.items() if _service(a) not in (None, "common")
           for b in bs if _service(b) not in (None, "common", _service(a)) and not _is_face(b)]
    assert bad == []


def test_the_coordinator_imports_only_faces_and_services_common(graph):
    bad = [f"{a} -> {b}" for a, bs in graph.items() if a.split(".")[0] == "coordinator"
           for b in bs if b.startswith("services") and _service(b) != "common" and not _is_face(b)]
    assert bad == []


def test_the_cli_reaches_runs_only_through_the_client(graph):
    """`meshrl` drives the run API as a script would (coordinator/client.py): it loads no loop or run manager."""
    bad = [f"{a} -> {b}" for a, bs in graph.items() if a.startswith("coordinator.cli")
           for b in bs if b.startswith(("coordinator.training", "coordinator.runapi"))]
    assert bad == []


def test_a_face_loads_no_implementation(graph):
    """Importing a service's config, types or convert never loads its engine (clients import faces)."""
    bad = [f"{a} -> {b}" for a, bs in graph.items() if _is_face(a)
           for b in bs if b.startswith("services") and _service(b) != "common" and not _is_face(b)]
    assert bad == []


def test_no_hand_written_file_is_over_450_lines_and_no_test_or_bench_over_600():
    long = []
    for top in (*SOURCE_DIRS, "tests"):
        cap = MAX_FILE_LINES if top in ("bench", "tests") else MAX_SOURCE_FILE_LINES
        for path in _python_files(top):
            lines = len(path.read_text().splitlines())
            if lines > cap:
                long.append(f"{path.relative_to(ROOT)}: {lines} (cap {cap})")
    assert long == []


def test_no_function_outside_bench_is_over_60_lines():
    long = []
    for top in ("services", "coordinator", "examples", "tests"):
        for path in _python_files(top):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines}")
    assert long == []


def test_no_source_folder_holds_more_than_15_modules():
    """A package's own modules (not __init__/__main__) per folder: past a dozen, split the folder by concern.
    bench/ is a folder of scripts run by path (docs, bench/gpu_session.sh, each result's provenance), not a package."""
    crowded = []
    folders = sorted({p.parent for top in ("services", "coordinator", "examples") for p in _python_files(top)})
    assert {"cli", "recipe", "runapi", "training", "rpc", "tensors", "engine_torch", "agents", "weights"} <= {
        f.name for f in folders}
    for folder in folders:
        modules = [p for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
        if len(modules) > MAX_FOLDER_MODULES:
            crowded.append(f"{folder.relative_to(ROOT)}: {len(modules)}")
    assert crowded == []


def test_the_rules_see_the_tree():
    """The walk finds the services and the coordinator, so an empty graph cannot pass the rules above."""
    modules = _source_modules()
    assert {"coordinator.training.loop", "services.common.rpc.server", "services.rollout.servicer"} <= set(modules)
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]


def test_every_service_shows_its_face():
    for role in ("rollout", "reward", "reference", "trainer", "env"):
        folder = ROOT / "services" / role
        assert (folder / "config.py").is_file(), f"services/{role}/config.py"
        assert (folder / "types.py").is_file(), f"services/{role}/types.py"

