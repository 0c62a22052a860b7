"""The walks of docs/architecture.md ("One knob, file by file") hold: `actor.lr` crosses at most 10 files, enters the
trainer's engine in one function and has one class and one name from the recipe to the proto; every module whose
code touches its path is on the list (a new hop, type or converter fails here); `rollout.temperature` stays
one-way (no rollout answer carries it)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from coordinator.recipe.config import RunConfig
from meshrl.v1 import rollout_pb2, trainer_pb2
from services.trainer import config as trainer_config
from services.trainer.config import RUN_OPTIM_KEYS, OptimSection

ROOT = Path(__file__).resolve().parents[2]
MAX_FILES = 10
# What the actor.lr walk's code calls its carriers: a module that names one of these is on the walk.
WALK_SYMBOLS = {"RUN_OPTIM_KEYS", "RunOptim", "run_optim_to_pb", "run_optim_from_pb", "optim_to_pb", "optim_from_pb",
                "with_run", "apply_hyperparams", "settings_in_effect", "ConfigureRun", "configure_run",
                "OptimSettings"}


def walk(knob: str) -> list[str]:
    """The files of `knob`'s walk, in order, as docs/architecture.md lists them (one bullet, its backticked paths)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    m = re.search(rf"^- `{re.escape(knob)}`(.*?)(?=^- |^\s*$)", text, re.M | re.S)
    assert m, f"docs/architecture.md lists no walk for {knob}"
    return re.findall(r"`([\w./-]+\.(?:py|yaml|proto))`", m.group(1))


def source_modules():
    for folder in ("services", "coordinator"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if not path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text())


def names(node: ast.AST) -> set[str]:
    """The identifiers a piece of code uses or defines (not its comments or strings)."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.alias):
            out.add(n.name)
    return out


def test_the_actor_lr_walk_crosses_at_most_ten_files_that_exist():
    files = walk("actor.lr")
    assert len(files) == len(set(files)), f"a file listed twice: {files}"
    assert len(files) <= MAX_FILES, f"actor.lr crosses {len(files)} files: {files}"
    assert [f for f in files if not (ROOT / f).is_file()] == []
    assert files[0].endswith(".yaml") and files[-1] == "services/trainer/model/optim.py"
    assert files.count("services/trainer/engine.py") == 1


def test_every_module_that_touches_the_path_is_on_the_walk():
    on_path = {rel for rel, tree in source_modules() if names(tree) & WALK_SYMBOLS}
    listed = set(walk("actor.lr"))
    # The training API's OptimStep reaches the same optimizer by its own walk (Tinker's AdamParams per call).
    api = set(walk("adam_params.learning_rate"))
    assert on_path - listed - api == set(), "modules on actor.lr's path that docs/architecture.md's walks miss"
    # And the list is no wish: each Python file on it names the path (the recipe's side names the sections).
    assert {f for f in listed if f.endswith(".py")} - on_path <= {"coordinator/recipe/config.py"}


def test_the_engine_is_entered_in_one_function():
    tree = ast.parse((ROOT / "services/trainer/engine.py").read_text())
    entered = {f.name for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
               and names(ast.Module(body=f.body, type_ignores=[])) & WALK_SYMBOLS}
    # A private helper counts as the function that calls it (configure_run's named-adapter branch).
    functions = {f.name: f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for name in [n for n in entered if n.startswith("_")]:
        callers = {c for c, f in functions.items() if c != name and name in names(ast.Module(body=f.body,
                                                                                                type_ignores=[]))}
        assert callers <= {"configure_run"}, f"{name} enters the walk from {callers}"
        entered.discard(name)
    assert entered == {"configure_run", "optim_step"}   # a run's ConfigureRun; the training API's OptimStep


def test_one_name_and_one_class_per_knob():
    assert [f.name for f in trainer_pb2.OptimSettings.DESCRIPTOR.fields] == list(RUN_OPTIM_KEYS)
    assert set(RUN_OPTIM_KEYS) <= set(OptimSection.model_fields)
    assert issubclass(RunConfig.model_fields["actor"].annotation, OptimSection)
    declaring = {(rel, c.name) for rel, tree in source_modules() for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
                 for s in c.body if isinstance(s, ast.AnnAssign) and getattr(s.target, "id", None) == "lr"}
    assert {rel for rel, _ in declaring} == {"services/trainer/config.py"}
    assert all(issubclass(getattr(trainer_config, name), OptimSection) for _, name in declaring)


def reachable_fields(message, seen=None) -> set[str]:
    seen = set() if seen is None else seen
    if message.full_name in seen:
        return set()
    seen.add(message.full_name)
    out = set()
    for f in message.fields:
        out.add(f.name)
        if f.message_type is not None:
            out |= reachable_fields(f.message_type, seen)
    return out


def test_the_rollout_temperature_walk_is_one_way():
    files = walk("rollout.temperature")
    assert [f for f in files if not (ROOT / f).is_file()] == []
    assert all("temperature" in (ROOT / f).read_text() or "sampling" in (ROOT / f).read_text() for f in files)
    service = rollout_pb2.DESCRIPTOR.services_by_name["Rollout"]
    assert "temperature" in reachable_fields(service.methods_by_name["Generate"].input_type)
    answers = {m.name: reachable_fields(m.output_type) for m in service.methods}
    assert {name for name, fields in answers.items() if "temperature" in fields} == set()


@pytest.mark.parametrize("knob", ["actor.lr", "rollout.temperature"])
def test_the_recipe_sets_the_knob_by_its_name(knob):
    section, key = knob.split(".")
    recipe = ROOT / walk(knob)[0]
    assert re.search(rf"^{section}:\n(?:  .*\n)*?  {key}: ", recipe.read_text(), re.M)
