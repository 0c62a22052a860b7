"""Observation tokens of an episode from the chat template's delta: what the template adds after the model's turn
(its end-of-turn text, the tool or environment turns, the next generation prompt), tokenised alone.

An episode's ids are the prompt ids, then each turn's ids exactly as sampled, then these delta ids; the
conversation is never re-tokenised whole (that drifts: BPE merges across a turn boundary differ from the
sampled ids). The rollout replica's episode loop and proxy mode both use it (docs/agentic.md).
"""

from __future__ import annotations

from typing import Any, Sequence

# Stands in for the model's last turn: the delta is what the template renders after it.
SENTINEL = "\u2063MESHRL-TURN\u2063"


def observation_text(tokenizer, new_messages: Sequence[dict], *, end_text: str = "",
                     tools: list[dict] | None = None) -> str:
    """The text the template puts after an assistant turn when `new_messages` (tool results, a user turn) follow,
    up to and including the next generation prompt. `end_text` is the text of the stop token the model already
    sampled (e.g. `<|im_end|>`): the template's copy of it is not repeated. ValueError when the template renders
    the earlier turns differently once a turn is added (token-exact deltas are impossible with it)."""
    if not new_messages:
        raise ValueError("new_messages: give at least one message to append")
    base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": SENTINEL}]
    kwargs: dict[str, Any] = {"tokenize": False, **({"tools": tools} if tools else {})}
    before = tokenizer.apply_chat_template(base, add_generation_prompt=False, **kwargs)
    after = tokenizer.apply_chat_template([*base, *new_messages], add_generation_prompt=True, **kwargs)
    cut = before.rfind(SENTINEL)
    if cut < 0:
        raise ValueError("chat template: it drops the assistant's content, so turns cannot be appended token-exact")
    cut += len(SENTINEL)
    if after[:cut] != before[:cut]:
        raise ValueError("chat template: adding a turn changes how earlier turns render (e.g. it drops earlier "
                         "reasoning), so observation tokens cannot be appended token-exact")
    delta = after[cut:]
    if end_text and delta.startswith(end_text):
        delta = delta[len(end_text):]
    return delta


def observation_ids(tokenizer, new_messages: Sequence[dict], *, end_text: str = "",
                    tools: list[dict] | None = None) -> list[int]:
    """observation_text tokenised on its own (no special tokens added): the ids appended after the sampled ids,
    each with loss mask 0."""
    text = observation_text(tokenizer, new_messages, end_text=end_text, tools=tools)
    return list(tokenizer.encode(text, add_special_tokens=False))
