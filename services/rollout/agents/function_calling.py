"""OpenAI function calling for the rollout HTTP API: `tools` and `tool_choice` in, `tool_calls` out.

Tools reach the model through the chat template: a template that knows tools (Qwen2.5, Hermes) renders them
itself; for one that does not, the Hermes tools text goes into the system message, earlier assistant calls are
written as `<tool_call>` blocks and tool results as `<tool_response>` user turns. A forced `tool_choice`
("required", or one named function) is honoured by starting the answer with the call's opening text, so the model
can only continue a call. The answer's text is read by the tool-call parser (services.common.tool_calls).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from services.common.tool_calls import (OPEN, ParsedText, ToolCall, ToolCallParser, check_openai_tools,
                                        format_hermes, hermes_tools_prompt, parse_hermes, tool_call_from_openai,
                                        tool_call_to_openai)


@dataclass
class FunctionCalling:
    """What a chat request asked for: the tools, whether calls are parsed, and the text forced at the answer's
    start ("" = none)."""

    tools: list[dict] = field(default_factory=list)
    parse: bool = False
    prefix: str = ""
    parser: ToolCallParser = parse_hermes
    # parallel_tool_calls: false keeps the first call of an answer only.
    max_calls: int | None = None

    @classmethod
    def from_body(cls, body: dict) -> "FunctionCalling":
        if body.get("functions") or body.get("function_call"):
            raise ValueError("functions: the legacy functions API is not supported; send tools and tool_choice")
        if not body.get("tools"):
            if body.get("tool_choice") not in (None, "none", "auto"):
                raise ValueError("tool_choice: needs tools")
            return cls()
        tools = check_openai_tools(body["tools"])
        parallel = body.get("parallel_tool_calls", True)
        if not isinstance(parallel, bool):
            raise ValueError("parallel_tool_calls: must be true or false")
        calling = cls._for_choice(tools, body.get("tool_choice", "auto"))
        calling.max_calls = None if parallel else 1
        return calling

    @classmethod
    def _for_choice(cls, tools: list[dict], choice: Any) -> "FunctionCalling":
        if choice == "none":
            return cls()
        if choice == "auto":
            return cls(tools, True)
        if choice == "required":
            return cls(tools, True, OPEN + '\n{"name": "')
        name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
        if not isinstance(name, str):
            raise ValueError("tool_choice: must be 'none', 'auto', 'required' or "
                             "{'type': 'function', 'function': {'name': ...}}")
        if name not in {t["function"]["name"] for t in tools}:
            raise ValueError(f"tool_choice.function.name: {name!r} is not in tools")
        return cls(tools, True, OPEN + "\n" + json.dumps({"name": name})[:-1] + ', "arguments": ')

    def message(self, text: str) -> tuple[dict[str, Any], ParsedText | None]:
        """The assistant message of one sample's text (the forced prefix put back in front), and what the parser
        read (None when calls are not parsed)."""
        if not self.parse:
            return {"role": "assistant", "content": text}, None
        parsed = self.parser(self.prefix + text)
        if not parsed.calls:   # no call, or only malformed ones: the model's text is the answer
            return {"role": "assistant", "content": self.prefix + text}, parsed
        calls = parsed.calls[:self.max_calls]
        return {"role": "assistant", "content": parsed.content or None,
                "tool_calls": [tool_call_to_openai(c) for c in calls]}, parsed


def template_turns(messages: list, tokenizer, *, offset: int = 0) -> tuple[list[dict], bool]:
    """Messages as the chat template takes them (tool calls and tool turns spelled out where it knows none), and
    whether it renders tools itself; `offset` numbers the messages in errors (a proxy session's appended turns)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    native = "tools" in template and "tool_calls" in template
    return [_message(m, offset + i, native) for i, m in enumerate(messages)], native


def render_messages(messages: Any, tools: list[dict], tokenizer) -> str:
    """The prompt text of a chat: the template renders tools and tool turns itself when it knows them."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: must be a non-empty list")
    flat, native = template_turns(messages, tokenizer)
    if tools and not native:
        text = hermes_tools_prompt(tools)
        if flat[0]["role"] == "system":
            flat[0] = dict(flat[0], content=f"{flat[0]['content']}\n\n{text}")
        else:
            flat.insert(0, {"role": "system", "content": text})
    kwargs = {"tools": tools} if tools and native else {}
    return tokenizer.apply_chat_template(flat, add_generation_prompt=True, tokenize=False, **kwargs)


def _message(m: Any, i: int, native: bool) -> dict:
    if not isinstance(m, dict) or "role" not in m:
        raise ValueError(f"messages[{i}]: needs a role")
    content = m.get("content") or ""
    if isinstance(content, list):   # content parts: keep the text ones
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    calls = m.get("tool_calls") or []
    if not isinstance(calls, list):
        raise ValueError(f"messages[{i}].tool_calls: must be a list")
    parsed = [tool_call_from_openai(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
    if native:
        out: dict[str, Any] = {"role": m["role"], "content": content}
        if parsed:   # templates take arguments as a dict (they serialise it themselves)
            out["tool_calls"] = [{"type": "function", "id": c.id,
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in parsed]
        if m["role"] == "tool" and m.get("tool_call_id"):
            out["tool_call_id"] = m["tool_call_id"]
        return out
    if m["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    blocks = "\n".join(format_hermes(ToolCall(c.name, c.arguments, c.id)) for c in parsed)
    return {"role": m["role"], "content": "\n".join(part for part in (content, blocks) if part)}
