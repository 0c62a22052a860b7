"""User reward functions: the one loader of `package.module:function`.

A user function is called exactly like a built-in, `fn(*, prompt, response, response_ids, ground_truth,
data_source, **params)`, and returns a number. It is loaded and its signature checked when the service
starts; it then runs in worker processes (services.reward.workers) so a hang or a crash fails one
call with a status that names the function instead of taking the service down.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Sequence

from services.reward.types import SAMPLE_KWARGS

CALL_CONVENTION = "fn(*, prompt, response, response_ids, ground_truth, data_source, **params) -> float"


def load_function(path: str, *, params: Sequence[str] = ()) -> Callable[..., Any]:
    """Imports `package.module:function` and checks it can be called with the sample keywords and `params`.

    Raises ValueError with the path and what is wrong: a malformed path, a missing module or
    attribute, something not callable, or a signature that does not accept the keyword arguments.
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"function: {path!r} is not of the form 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ValueError(f"function {path!r}: cannot import module {module_name!r}: {e}") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing; say so
        raise ValueError(f"function {path!r}: importing {module_name!r} raised {type(e).__name__}: {e}") from None
    fn: Any = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"function {path!r}: module {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"function {path!r}: {type(fn).__name__} object is not callable")
    check_signature(fn, path, params)
    return fn


def check_signature(fn: Callable[..., Any], path: str, params: Sequence[str] = ()) -> None:
    """The signature must accept every sample keyword and every param, and require nothing else."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature; they will fail on the first call
        return
    names = [*SAMPLE_KWARGS, *params]
    try:
        sig.bind(**{name: None for name in names})
    except TypeError as e:
        accepts_var_kw = any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())
        missing = [] if accepts_var_kw else [n for n in names if n not in sig.parameters or
                                             sig.parameters[n].kind == inspect.Parameter.POSITIONAL_ONLY]
        what = (f"does not accept keyword argument(s) {', '.join(missing)}" if missing else
                f"cannot be called with the sample keywords{' and params' if params else ''} alone ({e})")
        hint = ""
        if "solution_str" in sig.parameters:
            hint = (" (a verl compute_score(data_source, solution_str, ground_truth, extra_info) needs a wrapper: "
                    "def fn(*, response, ground_truth, data_source, **kw): "
                    "return compute_score(data_source, response, ground_truth))")
        raise ValueError(f"function {path!r} {what}; reward functions are called as {CALL_CONVENTION}{hint}") \
            from None
