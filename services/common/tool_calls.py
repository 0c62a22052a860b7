"""Tool calls in model text: the pluggable parser (Qwen/Hermes `<tool_call>{...}</tool_call>` built in), and the
OpenAI shapes of tools and tool calls, shared by the rollout HTTP API and the episode loop.

A parser is a function `text -> ParsedText`. It never raises on what a model wrote: a call it cannot read is
kept as an error (`ParsedText.errors`), which the episode loop turns into an error observation for the model.
"""

from __future__ import annotations

import importlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from services.common.convert import json_field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


@dataclass
class ToolCall:
    """One call: a tool name and its arguments (a JSON object), with the id OpenAI clients echo back."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    id: str = ""

    def __post_init__(self):
        if not self.id:
            self.id = f"call_{uuid.uuid4().hex[:24]}"

    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class ParsedText:
    """A model turn split into its plain content, the calls it made, and the calls it botched (one error line each,
    e.g. `tool_call[1]: not JSON (Expecting ',' ...)`)."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def has_calls(self) -> bool:
        return bool(self.calls or self.errors)


ToolCallParser = Callable[[str], ParsedText]


def parse_hermes(text: str) -> ParsedText:
    """Qwen/Hermes format: each `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block is one call; a block
    left open at the end (generation stopped at `</tool_call>` or at the length limit) still counts. The text
    outside the blocks is the content."""
    if not isinstance(text, str):
        return ParsedText(content="", errors=[f"text: expected a string, got {type(text).__name__}"])
    calls, errors = [], []
    for i, match in enumerate(_BLOCK.finditer(text)):
        call = _read_call(match.group(1), f"tool_call[{i}]")
        if isinstance(call, str):
            errors.append(call)
        else:
            calls.append(call)
    content = _BLOCK.sub("", text).strip()
    return ParsedText(content=content, calls=calls, errors=errors)


def _read_call(body: str, where: str) -> ToolCall | str:
    """The call in one block, or the error text saying why it is not one."""
    try:
        value = json.loads(body.strip())
    except (ValueError, RecursionError) as e:
        return f"{where}: not JSON ({str(e)[:200]})"
    if not isinstance(value, dict):
        return f"{where}: must be a JSON object with name and arguments, got {type(value).__name__}"
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return f"{where}.name: must be a non-empty string"
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):   # some models write the arguments as a JSON string, as OpenAI's wire does
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError) as e:
            return f"{where}.arguments: not JSON ({str(e)[:200]})"
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return f"{where}.arguments: must be a JSON object, got {type(args).__name__}"
    return ToolCall(name=name, arguments=args)


def format_hermes(call: ToolCall) -> str:
    """A call as the Hermes block a model writes (for templates that know no tool calls, and for SFT data). `</` is
    written `<\\/` (the same JSON string), so a `</tool_call>` inside an argument cannot end the block."""
    body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False).replace("</", "<\\/")
    return f"{OPEN}\n{body}\n{CLOSE}"


# Parsers by name; a user parser comes in as `package.module:function` (see load_parser).
TOOL_CALL_PARSERS: dict[str, ToolCallParser] = {"hermes": parse_hermes, "qwen": parse_hermes}


def load_parser(name: str) -> ToolCallParser:
    """A registered parser by name, or a user one as `package.module:function`; errors name the value."""
    if name in TOOL_CALL_PARSERS:
        return TOOL_CALL_PARSERS[name]
    module, sep, attr = name.rpartition(":")
    if not sep or not module or not attr:
        raise ValueError(f"tool_call_parser: unknown parser {name!r} (built-ins: {', '.join(TOOL_CALL_PARSERS)}; "
                         f"or give 'package.module:function')")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"tool_call_parser: cannot load {name!r}: {e}") from None
    if not callable(fn):
        raise ValueError(f"tool_call_parser: {name!r} is not callable")
    return fn


# ---- OpenAI shapes


def check_openai_tools(tools: Any, key: str = "tools") -> list[dict]:
    """OpenAI `tools` as given by a client: a list of {"type": "function", "function": {"name", "description"?,
    "parameters"?}}; returns them with `function` normalised, errors name the item."""
    if not isinstance(tools, list):
        raise ValueError(f"{key}: must be a list of tool objects")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        at = f"{key}[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ValueError(f"{at}: must be an object with type 'function'")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"{at}.function.name: must be a non-empty string")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ValueError(f"{at}.function.parameters: must be a JSON schema object")
        if fn["name"] in seen:
            raise ValueError(f"{at}.function.name: {fn['name']!r} is given twice")
        seen.add(fn["name"])
        out.append({"type": "function", "function": {"name": fn["name"], "description": fn.get("description", ""),
                                                     "parameters": params}})
    return out


def tool_call_to_openai(call: ToolCall) -> dict:
    """A call as an OpenAI `tool_calls` item (arguments travel as a JSON string)."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json()}}


def tool_call_from_openai(item: Any, key: str) -> ToolCall:
    """An assistant message's `tool_calls` item; errors name the key."""
    fn = item.get("function") if isinstance(item, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"{key}.function.name: must be a string")
    args = fn.get("arguments") or "{}"
    if isinstance(args, str):
        args = json_field(args, f"{key}.function.arguments")
    if not isinstance(args, dict):
        raise ValueError(f"{key}.function.arguments: must be a JSON object")
    return ToolCall(name=fn["name"], arguments=args, id=str(item.get("id") or ""))


def hermes_tools_prompt(tools: list[dict]) -> str:
    """The system text that tells a model without a tool-aware chat template which tools it has, in the words of
    the Hermes/Qwen template (so a model fine-tuned on either reads it)."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{lines}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
            f"within {OPEN}{CLOSE} XML tags:\n{OPEN}\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n' + CLOSE)
