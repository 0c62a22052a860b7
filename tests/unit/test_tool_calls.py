"""The tool-call parser (Qwen/Hermes format) and the OpenAI shapes of tools and calls."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from services.common.tool_calls import (TOOL_CALL_PARSERS, ParsedText, ToolCall, check_openai_tools, format_hermes,
                                        load_parser, parse_hermes, tool_call_from_openai, tool_call_to_openai)


def test_a_hermes_block_becomes_a_call_and_the_rest_is_content():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'
    parsed = parse_hermes(text)
    assert parsed.content == "Let me compute."
    assert [(c.name, c.arguments) for c in parsed.calls] == [("calculator", {"expression": "12*34"})]
    assert parsed.errors == []


def test_several_calls_keep_their_order_and_an_unclosed_last_block_counts():
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call> and '
            '<tool_call>{"name": "b", "arguments": "{\\"x\\": 1}"}')
    parsed = parse_hermes(text)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("a", {}), ("b", {"x": 1})]
    assert parsed.content == "and"


@pytest.mark.parametrize("body, error", [
    ('{"name": "calculator", "arguments": {"expression": "1+1"', "tool_call[0]: not JSON"),
    ('["calculator"]', "tool_call[0]: must be a JSON object"),
    ('{"arguments": {}}', "tool_call[0].name: must be a non-empty string"),
    ('{"name": "x", "arguments": [1, 2]}', "tool_call[0].arguments: must be a JSON object"),
    ('{"name": "x", "arguments": "{oops"}', "tool_call[0].arguments: not JSON"),
])
def test_a_malformed_call_is_an_error_that_names_it_not_an_exception(body, error):
    parsed = parse_hermes(f"<tool_call>{body}</tool_call>")
    assert parsed.calls == []
    assert parsed.errors[0].startswith(error)
    assert parsed.has_calls


def test_text_without_calls_is_all_content():
    assert parse_hermes("  the answer is 42 ") == ParsedText(content="the answer is 42")


def test_format_hermes_round_trips_through_the_parser():
    call = ToolCall(name="python", arguments={"code": "print('<tool_call>')"})
    parsed = parse_hermes("ok " + format_hermes(call))
    assert [(c.name, c.arguments) for c in parsed.calls] == [("python", call.arguments)]


_pieces = st.sampled_from(["<tool_call>", "</tool_call>", "{", "}", '"name"', '"arguments"', ":", ",", '"x"', "[",
                           "]", "null", "1e999", "\\", '"', "\n", "<tool_", "call>", "{" * 50, "[" * 2000])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=20), _pieces), max_size=30).map("".join))
def test_fuzzed_text_never_crashes_the_parser(text):
    parsed = parse_hermes(text)
    assert isinstance(parsed.content, str)
    # A call opened is never lost: it is a call or an error (an open tag inside a block is part of that block).
    opened = text.count("<tool_call>")
    assert (opened > 0) == parsed.has_calls
    assert len(parsed.calls) + len(parsed.errors) <= opened
    assert "<tool_call>" not in parsed.content
    for call in parsed.calls:
        assert isinstance(call.name, str) and call.name and isinstance(call.arguments, dict)
        json.loads(call.arguments_json())


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=8), st.recursive(st.none() | st.booleans() | st.integers() | st.text(),
                                                         lambda c: st.lists(c) | st.dictionaries(st.text(), c),
                                                         max_leaves=10), max_size=4),
       st.text(min_size=1, max_size=12))
def test_any_json_arguments_survive_format_then_parse(arguments, name):
    parsed = parse_hermes(format_hermes(ToolCall(name=name, arguments=arguments)))
    assert [(c.name, c.arguments) for c in parsed.calls] == [(name, arguments)]


def test_parsers_are_a_registry_and_user_parsers_load_by_path():
    assert TOOL_CALL_PARSERS["qwen"] is parse_hermes
    assert load_parser("services.common.tool_calls:parse_hermes") is parse_hermes
    with pytest.raises(ValueError, match="tool_call_parser: unknown parser 'llama'"):
        load_parser("llama")
    with pytest.raises(ValueError, match="tool_call_parser: cannot load"):
        load_parser("no.such.module:fn")


def test_openai_tool_calls_carry_arguments_as_a_json_string_and_come_back():
    call = ToolCall(name="calculator", arguments={"expression": "2*3"}, id="call_1")
    item = tool_call_to_openai(call)
    assert item == {"id": "call_1", "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "2*3"}'}}
    assert tool_call_from_openai(item, "messages[1].tool_calls[0]") == call
    with pytest.raises(ValueError, match=r"messages\[1\].tool_calls\[0\].function.arguments: not JSON"):
        tool_call_from_openai({"function": {"name": "x", "arguments": "{"}}, "messages[1].tool_calls[0]")


def test_openai_tools_are_checked_by_item():
    tools = check_openai_tools([{"type": "function", "function": {"name": "calculator"}}])
    assert tools[0]["function"]["parameters"] == {"type": "object", "properties": {}}
    with pytest.raises(ValueError, match=r"tools\[1\].function.name: 'a' is given twice"):
        check_openai_tools([{"type": "function", "function": {"name": "a"}}] * 2)
    with pytest.raises(ValueError, match=r"tools\[0\]: must be an object with type 'function'"):
        check_openai_tools([{"type": "retrieval"}])
