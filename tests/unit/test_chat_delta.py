"""Observation tokens from the chat template's delta: appended to sampled ids they rebuild the conversation the
template renders, without re-tokenising what the model sampled."""

from __future__ import annotations

import pytest

from services.common.chat_delta import observation_ids, observation_text
from services.rollout.testing import char_tokenizer

CHATML = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>\n{% endfor %}"
          "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_the_delta_is_what_the_template_adds_after_the_model_turn():
    tok = char_tokenizer()
    text = observation_text(tok, [{"role": "tool", "content": "408"}])
    assert text == "\nt:408\na:"     # the char template: end of the assistant line, the tool turn, the next prompt


def test_sampled_ids_plus_delta_ids_equal_the_rendered_three_turn_conversation():
    tok = char_tokenizer()
    tok.chat_template = CHATML
    history = [{"role": "user", "content": "12*34=?"}]
    ids = tok.encode(tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)
    turns = ["call 12*34", "call 408+1", "409"]
    observations = ["408", "409"]
    for i, turn in enumerate(turns):
        sampled = tok.encode(turn, add_special_tokens=False) + [tok.eos_token_id]   # stopped at eos
        ids += sampled
        history.append({"role": "assistant", "content": turn})
        if i < len(observations):
            new = [{"role": "tool", "content": observations[i]}]
            ids += observation_ids(tok, new, end_text="</s>")
            history += new
    rendered = tok.apply_chat_template(history, tokenize=False).rstrip("\n")
    assert ids == tok.encode(rendered, add_special_tokens=False)


def test_a_template_that_rewrites_earlier_turns_is_refused():
    tok = char_tokenizer()
    tok.chat_template = ("{% for m in messages %}{% if loop.last %}{{ m['content'] }}{% else %}x{% endif %}"
                         "{% endfor %}")
    with pytest.raises(ValueError, match="chat template: adding a turn changes how earlier turns render"):
        observation_text(tok, [{"role": "user", "content": "1"}])
