"""User reward functions: the one loader of `package.module:function` and of `path/to/file.py:function`.

A user function is called exactly like a built-in, `fn(*, prompt, response, response_ids, ground_truth,
data_source, **params)`, and returns a number. A verl reward file (`reward.custom_function: {path, name}`) is
called with verl's keywords, `fn(data_source=, solution_str=, ground_truth=, extra_info=, **params)`, and
returns a number or a dict with `score`. Either may be async. It is loaded and its signature checked when
the service starts; it then runs in worker processes (services.reward.workers) so a hang or a crash fails one
call with a status that names the function instead of taking the service down.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from services.reward.types import SAMPLE_KWARGS, VERL_KWARGS

CALL_CONVENTION = "fn(*, prompt, response, response_ids, ground_truth, data_source, **params) -> float"
VERL_CONVENTION = "fn(data_source, solution_str, ground_truth, extra_info, **reward_kwargs) -> float | {'score': ...}"
# Keywords by call convention (ComponentConfig.call).
CALL_KWARGS = {"meshrl": SAMPLE_KWARGS, "verl": VERL_KWARGS}


def is_file_path(module_part: str) -> bool:
    """`rewards/gsm8k.py` (a file) rather than `rewards.gsm8k` (a module)."""
    return module_part.endswith(".py") or "/" in module_part


def _import_file(file: str, path: str):
    """The module of a Python file, imported once per process under a name made from its absolute path."""
    resolved = Path(file).expanduser().resolve()
    if not resolved.is_file():
        raise ValueError(f"function {path!r}: file {file!r} does not exist")
    name = "meshrl_reward_" + hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as e:  # noqa: BLE001 - the user's file failed while importing; say so
        del sys.modules[name]
        raise ValueError(f"function {path!r}: importing {file!r} raised {type(e).__name__}: {e}") from None
    return module


def load_function(path: str, *, params: Sequence[str] = (), call: str = "meshrl") -> Callable[..., Any]:
    """Imports `package.module:function` (or `path/to/file.py:function`) and checks it can be called with the
    keywords of its call convention (`meshrl` or `verl`) and `params`.

    Raises ValueError with the path and what is wrong: a malformed path, a missing module, file or
    attribute, something not callable, or a signature that does not accept the keyword arguments.
    """
    module_name, sep, attr = path.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"function: {path!r} is not of the form 'package.module:function' or 'file.py:function'")
    if is_file_path(module_name):
        module = _import_file(module_name, path)
        fn = _attribute(module, attr, path, module_name)
        check_signature(fn, path, params, call)
        return fn
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ValueError(f"function {path!r}: cannot import module {module_name!r}: {e}") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing; say so
        raise ValueError(f"function {path!r}: importing {module_name!r} raised {type(e).__name__}: {e}") from None
    fn = _attribute(module, attr, path, module_name)
    check_signature(fn, path, params, call)
    return fn


def _attribute(module, attr: str, path: str, where: str) -> Callable[..., Any]:
    fn: Any = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"function {path!r}: {where!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"function {path!r}: {type(fn).__name__} object is not callable")
    return fn


def check_signature(fn: Callable[..., Any], path: str, params: Sequence[str] = (), call: str = "meshrl") -> None:
    """The signature must accept every keyword of the call convention and every param, and require nothing else."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature; they will fail on the first call
        return
    names = [*CALL_KWARGS[call], *params]
    convention = VERL_CONVENTION if call == "verl" else CALL_CONVENTION
    try:
        sig.bind(**{name: None for name in names})
    except TypeError as e:
        accepts_var_kw = any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())
        missing = [] if accepts_var_kw else [n for n in names if n not in sig.parameters or
                                             sig.parameters[n].kind == inspect.Parameter.POSITIONAL_ONLY]
        what = (f"does not accept keyword argument(s) {', '.join(missing)}" if missing else
                f"cannot be called with the sample keywords{' and params' if params else ''} alone ({e})")
        hint = ""
        if call == "meshrl" and "solution_str" in sig.parameters:
            hint = (" (a verl compute_score(data_source, solution_str, ground_truth, extra_info) plugs in as "
                    "reward.custom_function: {path: file.py, name: compute_score})")
        raise ValueError(f"function {path!r} {what}; reward functions are called as {convention}{hint}") from None
