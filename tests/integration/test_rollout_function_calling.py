"""OpenAI function calling on the rollout HTTP API, driven by the official `openai` client: tools reach the prompt,
answers carry `tool_calls`, a forced tool_choice is honoured, malformed calls never fail the request.

The tiny random model cannot write a real call, so two engines are used: the real tiny model (tools rendered
into its prompt, response schema right) and a scripted engine whose answer text the test chooses (parsing)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from services.common.tool_calls import hermes_tools_prompt
from services.rollout.config import RolloutConfig, RolloutSettings
from services.rollout.http_api import start_http
from services.rollout.servicer import start
from services.rollout.testing import char_tokenizer, make_tiny_model
from services.rollout.types import GenerateBatch, PromptResult, RolloutEngine, SampleResult

openai = pytest.importorskip("openai")

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluates arithmetic.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
NATIVE_TEMPLATE = ("{% if tools %}T:{{ tools | length }}{{ '\\n' }}{% endif %}{% for m in messages %}"
                   "{{ m['role'][0] }}:{{ m['content'] }}{% for c in m.get('tool_calls', []) %}"
                   "[{{ c['function']['name'] }}]{% endfor %}{{ '\\n' }}{% endfor %}"
                   "{% if add_generation_prompt %}a:{% endif %}")


class ScriptedEngine(RolloutEngine):
    """Answers every prompt with the text the test set; keeps the prompts it was given."""

    model_path = "scripted"

    def __init__(self, template: str | None = None):
        self.tokenizer = char_tokenizer()
        if template:
            self.tokenizer.chat_template = template
        self.answer = ""
        self.prompts: list[str] = []

    async def generate(self, batch: GenerateBatch) -> list[PromptResult]:
        self.prompts += [p.text for p in batch.prompts]
        ids = self.tokenizer.encode(self.answer, add_special_tokens=False)
        sample = SampleResult(ids, [0.0] * len(ids), self.answer, "stop", 0)
        return [PromptResult(p.id, self.tokenizer.encode(p.text, add_special_tokens=False),
                             [sample] * batch.sampling.n) for p in batch.prompts]

    async def logprobs(self, prompts, responses, temperature=1.0):
        raise NotImplementedError

    def info(self) -> dict:
        return {"engine": "scripted"}

    async def update_weights(self, manifest, buckets):
        raise NotImplementedError


@contextlib.asynccontextmanager
async def scripted_api(engine: ScriptedEngine):
    runner, port = await start_http(engine, host="127.0.0.1", port=0, model_name="tiny", defaults=RolloutConfig())
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
    try:
        yield client
    finally:
        await client.close()
        await runner.cleanup()


def _chat(engine: ScriptedEngine, answer: str, **kwargs):
    engine.answer = answer

    async def main():
        async with scripted_api(engine) as client:
            if kwargs.pop("stream", False):
                return [c async for c in await client.chat.completions.create(model="tiny", stream=True, **kwargs)]
            return await client.chat.completions.create(model="tiny", **kwargs)

    return asyncio.run(main())


ASK = [{"role": "user", "content": "12*34=?"}]


def test_a_call_in_the_answer_comes_back_as_tool_calls():
    engine = ScriptedEngine()
    answer = 'Let me compute.<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'
    resp = _chat(engine, answer, messages=ASK, tools=[CALCULATOR])
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me compute."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "calculator" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"expression": "12*34"}
    # The tools went into the prompt as the Hermes system text (this template knows no tools).
    assert engine.prompts[0].startswith("<s>s:" + hermes_tools_prompt([CALCULATOR]))


def test_a_malformed_call_is_answered_as_text_with_the_parse_error():
    engine = ScriptedEngine()
    resp = _chat(engine, '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>',
                 messages=ASK, tools=[CALCULATOR])
    choice = resp.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content.startswith("<tool_call>")
    assert choice.model_extra["tool_call_errors"][0].startswith("tool_call[0]: not JSON")


def test_tool_choice_none_leaves_tools_out_and_calls_unparsed():
    engine = ScriptedEngine()
    answer = '<tool_call>{"name": "calculator", "arguments": {}}</tool_call>'
    resp = _chat(engine, answer, messages=ASK, tools=[CALCULATOR], tool_choice="none")
    assert resp.choices[0].message.content == answer and resp.choices[0].message.tool_calls is None
    assert engine.prompts[0] == "<s>u:12*34=?\na:"


def test_a_named_tool_choice_starts_the_answer_with_that_call():
    engine = ScriptedEngine()
    resp = _chat(engine, '{"expression": "1+1"}}\n</tool_call>', messages=ASK, tools=[CALCULATOR],
                 tool_choice={"type": "function", "function": {"name": "calculator"}})
    assert engine.prompts[0].endswith('a:<tool_call>\n{"name": "calculator", "arguments": ')
    [call] = resp.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("calculator", {"expression": "1+1"})


def test_earlier_calls_and_tool_results_are_rendered_for_the_next_turn():
    engine = ScriptedEngine()
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "12*34"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "408"}]
    resp = _chat(engine, "The answer is 408.", messages=history, tools=[CALCULATOR])
    assert resp.choices[0].message.content == "The answer is 408." and resp.choices[0].finish_reason == "stop"
    prompt = engine.prompts[0]
    assert ('a:<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>\n'
            'u:<tool_response>\n408\n</tool_response>\na:') in prompt


def test_a_template_that_knows_tools_renders_them_itself():
    engine = ScriptedEngine(NATIVE_TEMPLATE)
    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}]}]
    _chat(engine, "ok", messages=history, tools=[CALCULATOR])
    assert engine.prompts[0] == "T:1\nu:12*34=?\na:[calculator]\na:"


def test_streamed_tool_calls_carry_their_index():
    engine = ScriptedEngine()
    answer = ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>'
              '<tool_call>{"name": "calculator", "arguments": {"expression": "2"}}</tool_call>')
    chunks = _chat(engine, answer, messages=ASK, tools=[CALCULATOR], stream=True)
    calls = chunks[0].choices[0].delta.tool_calls
    assert [(c.index, json.loads(c.function.arguments)) for c in calls] == [(0, {"expression": "1"}),
                                                                           (1, {"expression": "2"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # parallel_tool_calls: false keeps the first call only.
    single = _chat(engine, answer, messages=ASK, tools=[CALCULATOR], parallel_tool_calls=False)
    assert [json.loads(c.function.arguments) for c in single.choices[0].message.tool_calls] == [{"expression": "1"}]


@pytest.mark.parametrize("kwargs, field", [
    (dict(tools=[CALCULATOR], tool_choice={"type": "function", "function": {"name": "search"}}),
     "tool_choice.function.name: 'search' is not in tools"),
    (dict(tools=[{"type": "function", "function": {}}]), "tools[0].function.name"),
    (dict(tool_choice="required"), "tool_choice: needs tools"),
    (dict(functions=[{"name": "f"}]), "functions: the legacy functions API is not supported"),
])
def test_bad_tool_requests_are_400_naming_the_field(kwargs, field):
    engine = ScriptedEngine()
    with pytest.raises(openai.BadRequestError) as err:
        _chat(engine, "x", messages=ASK, **kwargs)
    assert field in str(err.value)


def test_the_tiny_model_gets_the_tools_in_its_prompt_and_answers_in_the_openai_schema(tmp_path):
    model = make_tiny_model(tmp_path / "model", max_position_embeddings=2048)

    async def main():
        settings = RolloutSettings(model={"path": model}, rollout=dict(http_port=0, served_model_name="tiny"))
        mesh, _, replica = await start(settings, "127.0.0.1:0")
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{replica.http_port}/v1", api_key="none",
                                    max_retries=0, timeout=120)
        try:
            common = dict(model="tiny", messages=ASK, max_tokens=8, temperature=0,
                          extra_body={"return_token_ids": True})
            auto = await client.chat.completions.create(tools=[CALCULATOR], **common)
            forced = await client.chat.completions.create(tools=[CALCULATOR], tool_choice="required", **common)
            return auto, forced
        finally:
            await client.close()
            await mesh.stop(0)
            await replica.close()

    auto, forced = asyncio.run(main())
    # The prompt the model read: the tools as the Hermes system turn, then the chat; forced, the call's opening.
    prompt = "<s>s:" + hermes_tools_prompt([CALCULATOR]) + "\nu:12*34=?\na:"
    tok = char_tokenizer()
    assert auto.choices[0].model_extra["prompt_token_ids"] == tok.encode(prompt, add_special_tokens=False)
    assert forced.choices[0].model_extra["prompt_token_ids"] == tok.encode(prompt + '<tool_call>\n{"name": "',
                                                                           add_special_tokens=False)
    for resp in (auto, forced):
        assert resp.object == "chat.completion" and resp.choices[0].message.role == "assistant"
        assert resp.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The forced opening is part of the answer; what the random model wrote after it is no call, and says why.
    assert forced.choices[0].message.content.startswith('<tool_call>\n{"name": "')
    assert forced.choices[0].model_extra["tool_call_errors"][0].startswith("tool_call[0]")
