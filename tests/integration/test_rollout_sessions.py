"""Proxy mode: an agent that only knows an OpenAI base_url (the official `openai` client here) talks to a rollout
replica at /sessions/<id>/v1; the replica records the session token-exact: prompt ids, sampled ids and the chat
template's delta for the tool turns, with the loss mask 1 on sampled and 0 on observation tokens."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest

from services.common.chat_delta import observation_ids
from services.common.tool_calls import ToolCall, format_hermes
from services.rollout.agents.function_calling import render_messages
from services.rollout.config import RolloutConfig, RolloutSettings
from services.rollout.http_api import start_http
from services.rollout.servicer import start
from services.rollout.testing import char_tokenizer, make_tiny_model
from services.rollout.types import GenerateBatch, PromptResult, RolloutEngine, SampleResult

openai = pytest.importorskip("openai")

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluates arithmetic.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
ASK = [{"role": "user", "content": "12*34=?"}]


def _as_dict(message) -> dict:
    """An answer's message as an agent sends it back (the client's own serialisation)."""
    return message.model_dump(exclude_none=True)


async def _get(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        return resp.status, await resp.json()


def test_two_turns_with_a_tool_message_are_recorded_as_prompt_sampled_and_template_delta_ids(tmp_path):
    model = make_tiny_model(tmp_path / "model", max_position_embeddings=512)

    async def main():
        settings = RolloutSettings(model={"path": model}, rollout=dict(http_port=0, served_model_name="tiny"))
        mesh, _, replica = await start(settings, "127.0.0.1:0")
        root = f"http://127.0.0.1:{replica.http_port}"
        agent = openai.AsyncOpenAI(base_url=f"{root}/sessions/agent-1/v1", api_key="none", max_retries=0,
                                   timeout=120)
        try:
            common = dict(model="tiny", max_tokens=6, temperature=1.0, logprobs=True,
                          extra_body={"return_token_ids": True})
            first = await agent.chat.completions.create(messages=ASK, **common)
            history = [*ASK, _as_dict(first.choices[0].message),
                       {"role": "tool", "tool_call_id": "call_1", "content": "408"}]
            second = await agent.chat.completions.create(messages=history, **common)
            return first, second, await _get(f"{root}/sessions/agent-1")
        finally:
            await agent.close()
            await mesh.stop(0)
            await replica.close()

    first, second, (status, session) = asyncio.run(main())
    tok = char_tokenizer()
    ids1, ids2 = (r.choices[0].model_extra["token_ids"] for r in (first, second))
    prompt1 = first.model_extra["prompt_token_ids"]
    assert prompt1 == tok.encode("<s>u:12*34=?\na:", add_special_tokens=False)
    # The template's delta after the model's turn: its end of turn, the tool turn (this template knows no tool
    # role: a <tool_response> user turn), the next generation prompt; each character one id.
    delta = tok.encode("\nu:<tool_response>\n408\n</tool_response>\na:", add_special_tokens=False)
    # What the model read on turn 2 is turn 1's prompt, its own sampled ids and the delta: nothing re-tokenised.
    assert second.model_extra["prompt_token_ids"] == prompt1 + ids1 + delta
    assert status == 200 and session["session_id"] == "agent-1" and session["num_turns"] == 2
    [seg] = session["segments"]
    assert seg["started_because"] == "first request" and seg["num_turns"] == 2
    assert seg["prompt_ids"] == prompt1
    assert seg["response_ids"] == ids1 + delta + ids2
    assert seg["loss_mask"] == [1] * len(ids1) + [0] * len(delta) + [1] * len(ids2)
    sampled_lp = [[c.logprob for c in r.choices[0].logprobs.content] for r in (first, second)]
    assert seg["logprobs"] == sampled_lp[0] + [0.0] * len(delta) + sampled_lp[1]
    assert seg["weight_versions"] == [0] * len(ids1) + [-1] * len(delta) + [0] * len(ids2)


class QueuedEngine(RolloutEngine):
    """Answers each request with the next text of `answers` (one id per character); keeps the prompt ids."""

    model_path = "scripted"
    max_model_len = 4096

    def __init__(self, answers: list[str], tokenizer=None, *, end_with_eos: bool = False):
        self.tokenizer = tokenizer or char_tokenizer()
        self.answers = list(answers)
        self.end_with_eos = end_with_eos      # a chat model's turn ends with its eos, which is sampled
        self.prompts: list[list[int]] = []
        self.sampled: list[list[int]] = []

    async def generate(self, batch: GenerateBatch) -> list[PromptResult]:
        [p] = batch.prompts
        ids = p.prompt_ids or self.tokenizer.encode(p.text, add_special_tokens=False)
        self.prompts.append(ids)
        text = self.answers.pop(0)
        out = self.tokenizer.encode(text, add_special_tokens=False)
        out += [self.tokenizer.eos_token_id] if self.end_with_eos else []
        self.sampled.append(out)
        sample = SampleResult(out, [-0.5] * len(out), text, "stop", self.weight_version)
        return [PromptResult(p.id, ids, [sample])]

    async def logprobs(self, prompts, responses, temperature=1.0):
        raise NotImplementedError

    def info(self) -> dict:
        return {"engine": "scripted"}

    async def update_weights(self, manifest, buckets):
        raise NotImplementedError


@contextlib.asynccontextmanager
async def proxy(engine: RolloutEngine):
    runner, port = await start_http(engine, host="127.0.0.1", port=0, model_name="tiny", defaults=RolloutConfig())
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def _client(root: str, session_id: str):
    return openai.AsyncOpenAI(base_url=f"{root}/sessions/{session_id}/v1", api_key="none", max_retries=0, timeout=60)


CALL_TEXT = 'Let me compute.<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'


def test_a_tool_call_keeps_the_ids_the_model_wrote_not_a_re_rendering_of_the_call():
    engine = QueuedEngine([CALL_TEXT, "It is 408."])

    async def main():
        async with proxy(engine) as root:
            agent = _client(root, "calls")
            first = await agent.chat.completions.create(model="tiny", messages=ASK, tools=[CALCULATOR])
            call = first.choices[0].message.tool_calls[0]
            history = [*ASK, _as_dict(first.choices[0].message),
                       {"role": "tool", "tool_call_id": call.id, "content": "408"}]
            await agent.chat.completions.create(model="tiny", messages=history, tools=[CALCULATOR])
            await agent.close()
            return history, await _get(f"{root}/sessions/calls")

    history, (_, session) = asyncio.run(main())
    tok = engine.tokenizer
    sampled = tok.encode(CALL_TEXT, add_special_tokens=False)
    delta = tok.encode("\nu:<tool_response>\n408\n</tool_response>\na:", add_special_tokens=False)
    assert engine.prompts[1] == engine.prompts[0] + sampled + delta
    # Rendering the whole conversation again writes the call as the template does, not as the model did.
    rerendered = tok.encode(render_messages(history, [CALCULATOR], tok), add_special_tokens=False)
    assert rerendered != engine.prompts[1]
    assert format_hermes(ToolCall("calculator", {"expression": "12*34"})) in render_messages(history, [CALCULATOR], tok)
    [seg] = session["segments"]
    answer2 = tok.encode("It is 408.", add_special_tokens=False)
    assert seg["response_ids"] == sampled + delta + answer2
    assert seg["loss_mask"] == [1] * len(sampled) + [0] * len(delta) + [1] * len(answer2)
    assert seg["num_tool_calls"] == 1


def test_a_template_that_knows_tools_gets_its_tool_turn_appended_after_the_sampled_end_of_turn_token():
    from examples.toolcalc.chat import build_tokenizer

    tok = build_tokenizer()
    engine = QueuedEngine([CALL_TEXT, "It is 408."], tok, end_with_eos=True)

    async def main():
        async with proxy(engine) as root:
            agent = _client(root, "native")
            first = await agent.chat.completions.create(model="tiny", messages=ASK, tools=[CALCULATOR])
            call = first.choices[0].message.tool_calls[0]
            history = [*ASK, _as_dict(first.choices[0].message),
                       {"role": "tool", "tool_call_id": call.id, "content": "408"}]
            await agent.chat.completions.create(model="tiny", messages=history, tools=[CALCULATOR])
            await agent.close()
            return await _get(f"{root}/sessions/native")

    _, session = asyncio.run(main())
    # the template renders the tools and the tool turn itself; the model's <|end|> is not repeated
    assert tok.decode(engine.prompts[0]).startswith("<s><|system|>tools: calculator<|end|><|user|>12*34=?")
    delta = observation_ids(tok, [{"role": "tool", "content": "408", "tool_call_id": "x"}], end_text=tok.eos_token,
                            tools=[CALCULATOR])
    assert tok.decode(delta) == "<|tool|><tool_response>\n408\n</tool_response><|end|><|assistant|>"
    assert engine.prompts[1] == engine.prompts[0] + engine.sampled[0] + delta
    [seg] = session["segments"]
    assert seg["response_ids"] == engine.sampled[0] + delta + engine.sampled[1]
    assert seg["loss_mask"] == [1] * len(engine.sampled[0]) + [0] * len(delta) + [1] * len(engine.sampled[1])


def test_a_history_the_agent_rewrote_or_new_tools_start_a_new_segment_recorded_as_such():
    engine = QueuedEngine(["a1", "a2", "a3", "a4"])

    async def main():
        async with proxy(engine) as root:
            agent = _client(root, "diverge")
            first = await agent.chat.completions.create(model="tiny", messages=ASK)
            history = [*ASK, _as_dict(first.choices[0].message), {"role": "user", "content": "and 2*3?"}]
            await agent.chat.completions.create(model="tiny", messages=history)     # continues
            edited = [*ASK, {"role": "assistant", "content": "edited"}, {"role": "user", "content": "and 2*3?"}]
            await agent.chat.completions.create(model="tiny", messages=edited)      # rewrote an answer
            await agent.chat.completions.create(model="tiny", messages=edited + [
                {"role": "assistant", "content": "a3"}, {"role": "user", "content": "go"}], tools=[CALCULATOR])
            await agent.close()
            return await _get(f"{root}/sessions/diverge")

    _, session = asyncio.run(main())
    assert [s["started_because"] for s in session["segments"]] == ["first request", "history diverged",
                                                                    "tools changed"]
    assert [s["num_turns"] for s in session["segments"]] == [2, 1, 1]
    tok = engine.tokenizer
    # The new segment's prompt is the rewritten chat rendered whole, as a plain chat request would be.
    assert session["segments"][1]["prompt_ids"] == tok.encode(
        "<s>u:12*34=?\na:edited\nu:and 2*3?\na:", add_special_tokens=False)
    assert session["num_turns"] == 4


def test_a_session_that_does_not_exist_is_a_404_naming_it_and_n_above_one_or_a_completion_is_refused():
    engine = QueuedEngine(["x"])

    async def main():
        async with proxy(engine) as root:
            missing = await _get(f"{root}/sessions/nope-42")
            agent = _client(root, "n2")
            with pytest.raises(openai.BadRequestError) as err:
                await agent.chat.completions.create(model="tiny", messages=ASK, n=2)
            refused = await _get(f"{root}/sessions/n2")        # a refused request opened no session
            with pytest.raises(openai.BadRequestError, match="a session records chat requests only"):
                await agent.completions.create(model="tiny", prompt="12*34=")
            await agent.chat.completions.create(model="tiny", messages=ASK)
            async with aiohttp.ClientSession() as http, http.delete(f"{root}/sessions/n2") as resp:
                dropped = resp.status, await resp.json()
            gone = await _get(f"{root}/sessions/n2")
            await agent.close()
            return missing, err.value, refused, dropped, gone

    (status, body), err, refused, dropped, gone = asyncio.run(main())
    assert refused[0] == 404
    assert status == 404 and "session 'nope-42'" in body["error"]["message"]
    assert "n: a session records one answer per request, got 2" in str(err)
    assert dropped[0] == 200 and dropped[1]["num_turns"] == 1 and dropped[1]["segments"][0]["response_ids"]
    assert gone[0] == 404 and "'n2'" in gone[1]["error"]["message"]
