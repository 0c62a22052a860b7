"""The toolcalc tokenizer and chat template: one token per character, role markers as special tokens, and the
Hermes `<tool_call>` / `<tool_response>` tags as (non-special) single tokens, so the tags survive decoding with
`skip_special_tokens=True` (the episode loop parses the decoded text) and a call costs one token per tag.

The template renders system/user/assistant/tool messages (an assistant's OpenAI `tool_calls` as Hermes blocks, a
tool message as a `<tool_response>` turn) and is delta-stable: one more message plus the generation prompt only
appends text, which `services.common.chat_delta.observation_ids` relies on.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from examples.common import char_tokenizer

SPECIAL_TOKENS = ["<pad>", "<s>", "<|end|>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
TAG_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# Printable ASCII in GPT-2 byte-level spelling (space is "Ġ", newline "Ċ"): tool errors and JSON need all of it.
CHARS = ["\u0120" if c == " " else c for c in map(chr, range(32, 127))] + ["\u010a"]
MAX_LEN = 256
# A role marker, the message, the end-of-turn token (the eos, so a turn's generation stops there). A tool result is
# its own turn, `<|tool|><tool_response>\n...\n</tool_response><|end|>`; an assistant's calls are Hermes blocks after
# its content, written exactly as services.common.tool_calls.format_hermes writes them. With `tools`, a system turn
# names them (the model knows its one tool; its schema would cost hundreds of tokens).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>tools: {% for t in tools %}{{ t['function']['name'] if t['function'] is defined "
    "else t['name'] }}{% if not loop.last %}, {% endif %}{% endfor %}<|end|>{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}<|tool|><tool_response>\n{{ message['content'] }}\n</tool_response><|end|>"
    "{% else %}<|{{ message['role'] }}|>{{ message['content'] or '' }}"
    "{% for call in message['tool_calls'] or [] %}{% set fn = call['function'] if call['function'] is defined "
    "else call %}<tool_call>\n{\"name\": {{ fn['name'] | tojson }}, \"arguments\": "
    "{% if fn['arguments'] is string %}{{ fn['arguments'] }}{% else %}{{ fn['arguments'] | tojson }}{% endif %}}"
    "\n</tool_call>{% endfor %}<|end|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer with the chat template; encoding adds no special tokens (the template has bos)."""
    return char_tokenizer(SPECIAL_TOKENS + TAG_TOKENS + CHARS, SPECIAL_TOKENS, eos="<|end|>", max_len=MAX_LEN,
                          chat_template=CHAT_TEMPLATE, tags=TAG_TOKENS)


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The messages through the template once, with the generation prompt: exactly one bos."""
    out = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                        **({"tools": tools} if tools else {}))
    return list(out["input_ids"] if hasattr(out, "keys") else out)
