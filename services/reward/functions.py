"""Rule-based reward functions and their registry (exact match, GSM8K, MATH, boxed answers, format, length), and
the built-in reward each known `data_source` gets by default (DEFAULT_BY_DATA_SOURCE, the `default` rule).

Every function is called as `fn(*, prompt, response, response_ids, ground_truth, data_source, **params)`
and returns a float; `params` are the component's `params:` from the config. A bad param raises
ValueError naming it; `check_rule_params` calls a built-in once on an empty sample when the config loads, so
a typo in a regex or a negative length fails before anything starts, not mid-run.
"""

from __future__ import annotations

import functools
import inspect
import re
from decimal import Decimal, InvalidOperation
from typing import Any, Sequence

from services.reward.types import SAMPLE_KWARGS, RewardFn

# A plain decimal number: optional sign, digits with an optional fraction, optional exponent.
_NUMBER = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_GSM8K_RE = re.compile(r"####\s*\$?\s*([+-]?[\d,]*\.?\d+)")
_FLEXIBLE_NUMBER_RE = re.compile(r"[+-]?\d[\d,]*(?:\.\d+)?|[+-]?\.\d+")


def parse_number(text: str) -> Decimal | None:
    """`" +82.0 "` -> Decimal('82.0'); None unless the whole (stripped) text is one finite number."""
    text = text.strip()
    if not _NUMBER_RE.fullmatch(text):
        return None
    try:
        return Decimal(text)
    except InvalidOperation:  # pragma: no cover - the regex admits only valid decimals
        return None


def answers_equal(a: str, b: str) -> bool:
    """Equal after stripping whitespace; two numbers compare by value ("82" == "+82" == "82.0")."""
    a, b = a.strip(), b.strip()
    if a == b:
        return True
    na, nb = parse_number(a), parse_number(b)
    return na is not None and nb is not None and na == nb


def exact_match(*, prompt: str, response: str, response_ids: Sequence[int], ground_truth: str,
                data_source: str, **_: Any) -> float:
    """1.0 when the response is the ground truth (whitespace stripped, numbers compared by value)."""
    return 1.0 if answers_equal(response, ground_truth) else 0.0


def _gsm8k_answer(text: str) -> str | None:
    """The number after the last `####` (commas and `$` dropped), or None when there is none."""
    found = _GSM8K_RE.findall(text)
    return found[-1].replace(",", "") if found else None


def gsm8k(*, prompt: str, response: str, response_ids: Sequence[int], ground_truth: str, data_source: str,
          mode: str = "strict", format_score: float = 0.0, score: float = 1.0, **_: Any) -> float:
    """GSM8K's `#### answer` convention: `score` when the last number after `####` equals the ground truth.

    The ground truth may be a full GSM8K solution (its `####` answer is used) or the bare answer.
    `mode: flexible` falls back to the last number anywhere in the response when it has no `####`.
    `format_score` is given to a well-formed but wrong answer (verl's convention; 0 by default).
    """
    if mode not in ("strict", "flexible"):
        raise ValueError(f"params.mode: must be 'strict' or 'flexible', got {mode!r}")
    expected = _gsm8k_answer(ground_truth)
    if expected is None:
        expected = ground_truth.strip().replace(",", "")
    got = _gsm8k_answer(response)
    if got is None and mode == "flexible":
        numbers = _FLEXIBLE_NUMBER_RE.findall(response)
        got = numbers[-1].replace(",", "") if numbers else None
    if got is None:
        return 0.0
    return float(score) if answers_equal(got, expected) else float(format_score)


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), nested braces included; None if absent/unclosed."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def _normalise_math(text: str) -> str:
    """Drops what does not change a short math answer: spaces, `$`, `\\left`/`\\right`, a trailing period."""
    text = text.replace("\\left", "").replace("\\right", "").replace("$", "")
    text = re.sub(r"\s+", "", text)
    return text.rstrip(".")


def boxed(*, prompt: str, response: str, response_ids: Sequence[int], ground_truth: str, data_source: str,
          format_score: float = 0.0, score: float = 1.0, **_: Any) -> float:
    """`score` when the last `\\boxed{}` of the response equals the ground truth (itself boxed or bare)."""
    got = last_boxed(response)
    if got is None:
        return 0.0
    expected = last_boxed(ground_truth)
    expected = ground_truth if expected is None else expected
    return float(score) if answers_equal(_normalise_math(got), _normalise_math(expected)) else float(format_score)


def _unwrap(text: str, command: str) -> str:
    """`\\text{cm}` -> `cm` for every `\\command{...}` (no nested braces inside)."""
    return re.sub(r"\\" + command + r"\{([^{}]*)\}", r"\1", text)


def _fix_fracs(text: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{2}` -> `\\frac{1}{2}`: one-character arguments get braces."""
    text = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", text)
    text = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", text)
    return re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", text)


def normalise_math_answer(text: str) -> str:
    """A MATH final answer in one canonical spelling: what does not change its value is dropped (spaces,
    `$`, `\\left`/`\\right`, `\\!`, degrees, percent signs, `\\text{}` wrappers, a `x =` in front, a trailing
    period), `\\dfrac`/`\\tfrac` become `\\frac`, bare arguments get braces (`\\frac12`, `\\sqrt3`), `a/b` of
    two integers becomes `\\frac{a}{b}` and `0.5` becomes `\\frac{1}{2}`."""
    t = text.strip().replace("\n", "").replace("\\!", "")
    for old, new in (("\\left", ""), ("\\right", ""), ("dfrac", "frac"), ("tfrac", "frac"), ("\\$", ""),
                     ("$", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\%", ""), ("%", "")):
        t = t.replace(old, new)
    for command in ("text", "textbf", "mbox", "mathrm"):
        t = _unwrap(t, command)
    t = re.sub(r"\s+", "", t).rstrip(".")
    if re.fullmatch(r"[A-Za-z]\w?=.+", t):              # "x=5" -> "5"
        t = t.split("=", 1)[1]
    t = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", t)
    t = _fix_fracs(t)
    t = re.sub(r"(^|[^\d])\.(\d)", r"\g<1>0.\2", t)   # ".5" -> "0.5"
    if t == "0.5":
        t = "\\frac{1}{2}"
    if m := re.fullmatch(r"(-?\d+)/(\d+)", t):
        t = f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}"
    return t


def math_answer(*, prompt: str, response: str, response_ids: Sequence[int], ground_truth: str, data_source: str,
                format_score: float = 0.0, score: float = 1.0, **_: Any) -> float:
    """MATH's convention: `score` when the last `\\boxed{}` of the response equals the ground truth (itself a
    solution with a `\\boxed{}` or the bare answer) after `normalise_math_answer`; numbers compare by value."""
    got = last_boxed(response)
    if got is None:
        return 0.0
    expected = last_boxed(ground_truth)
    a, b = normalise_math_answer(got), normalise_math_answer(ground_truth if expected is None else expected)
    return float(score) if answers_equal(a, b) else float(format_score)


@functools.lru_cache(maxsize=64)
def _compile(pattern: str, dotall: bool, ignore_case: bool) -> re.Pattern:
    flags = (re.DOTALL if dotall else 0) | (re.IGNORECASE if ignore_case else 0)
    try:
        return re.compile(pattern, flags)
    except re.error as e:
        raise ValueError(f"params.pattern: invalid regular expression {pattern!r}: {e}") from None


def format_reward(*, prompt: str, response: str, response_ids: Sequence[int], ground_truth: str, data_source: str,
           pattern: str | None = None, match: str = "fullmatch", dotall: bool = True, ignore_case: bool = False,
           strip: bool = True, **_: Any) -> float:
    """1.0 when the response matches `pattern` (`match: fullmatch` the whole response, or `search` anywhere).

    Example: `pattern: "<think>.*</think>\\s*<answer>.*</answer>"` rewards the R1 output format.
    """
    if not isinstance(pattern, str) or not pattern:
        raise ValueError("params.pattern: required, a regular expression")
    if match not in ("fullmatch", "search"):
        raise ValueError(f"params.match: must be 'fullmatch' or 'search', got {match!r}")
    regex = _compile(pattern, bool(dotall), bool(ignore_case))
    text = response.strip() if strip else response
    found = regex.fullmatch(text) if match == "fullmatch" else regex.search(text)
    return 1.0 if found else 0.0


def length_penalty(*, prompt: str, response: str, response_ids: Sequence[int], ground_truth: str,
                   data_source: str, max_length: int | None = None, target: int = 0, scale: float = 1.0,
                   unit: str = "tokens", **_: Any) -> float:
    """A penalty in [-scale, 0]: 0 up to `target`, falling linearly to -scale at `max_length` and beyond.

    With `target = max_length - buffer` this is DAPO's soft overlong punishment. Length is counted in
    response tokens (`unit: tokens`, the default) or characters (`unit: chars`).
    """
    if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length <= 0:
        raise ValueError(f"params.max_length: required, a positive integer, got {max_length!r}")
    if not isinstance(target, int) or not 0 <= target < max_length:
        raise ValueError(f"params.target: must be an integer in [0, max_length={max_length}), got {target!r}")
    if unit not in ("tokens", "chars"):
        raise ValueError(f"params.unit: must be 'tokens' or 'chars', got {unit!r}")
    if scale < 0:
        raise ValueError(f"params.scale: must be >= 0, got {scale!r}")
    if unit == "tokens":
        if response and not response_ids:
            raise ValueError("response_ids: empty, but length_penalty counts tokens (set params.unit: chars "
                             "to count characters)")
        length = len(response_ids)
    else:
        length = len(response)
    excess = min(1.0, max(0.0, (length - target) / (max_length - target)))
    return -float(scale) * excess


# The built-in reward a row's data_source gets from the `default` rule (verl's default_compute_score names;
# "" is a row without a data_source, "arith" the project's own example task).
DEFAULT_BY_DATA_SOURCE: dict[str, str] = {
    "": "exact_match",
    "arith": "exact_match",
    "openai/gsm8k": "gsm8k",
    "gsm8k": "gsm8k",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "math": "math",
}


def default_rule_for(data_source: str) -> str:
    """The built-in rule the `default` reward uses for `data_source`; ValueError naming it when none."""
    name = DEFAULT_BY_DATA_SOURCE.get(data_source)
    if name is None:
        known = ", ".join(repr(k) for k in DEFAULT_BY_DATA_SOURCE if k)
        raise ValueError(f"data_source {data_source!r} has no default reward (known: {known}); set "
                         f"reward.components, reward.custom_function or reward.by_data_source.{data_source or '<name>'}")
    return name


def default_reward(*, prompt: str, response: str, response_ids: Sequence[int], ground_truth: str,
                   data_source: str, **_: Any) -> float:
    """The built-in reward of the item's data_source (DEFAULT_BY_DATA_SOURCE): GSM8K rows get `gsm8k`
    (strict), MATH rows `math`, rows without a data_source `exact_match`; an unknown data_source is refused."""
    fn = REWARD_FUNCTIONS[default_rule_for(data_source)]
    return fn(prompt=prompt, response=response, response_ids=response_ids, ground_truth=ground_truth,
              data_source=data_source)


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "default": default_reward,
    "exact_match": exact_match,
    "gsm8k": gsm8k,
    "math": math_answer,
    "boxed": boxed,
    "format": format_reward,
    "length_penalty": length_penalty,
}


def check_rule_params(name: str, params: dict, where: str) -> None:
    """Rejects params a built-in does not declare (typos), then calls it once on an empty sample so a
    bad value (an invalid regex, a negative length) fails at start with its key named."""
    fn = REWARD_FUNCTIONS[name]
    declared = [p.name for p in inspect.signature(fn).parameters.values()
                if p.kind == p.KEYWORD_ONLY and p.name not in SAMPLE_KWARGS]
    for key in params:
        if key not in declared:
            raise ValueError(f"{where}.params.{key}: unknown param of {name} (it takes: {', '.join(declared) or 'none'})")
    try:
        fn(prompt="", response="", response_ids=[], ground_truth="", data_source="", **params)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where} ({name}): {e}") from None
