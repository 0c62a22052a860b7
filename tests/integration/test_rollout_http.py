"""The rollout replica's OpenAI-compatible HTTP API, driven by the official `openai` client."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from services.rollout.config import RolloutSettings
from services.rollout.servicer import start
from services.rollout.testing import make_tiny_model

pytest.importorskip("aiohttp")   # the HTTP API server (pyproject: add aiohttp)
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("rollout_http_model"))


@contextlib.asynccontextmanager
async def http_replica(model_dir: str, *, token: str | None = None, **rollout):
    settings = RolloutSettings(model={"path": model_dir}, rollout=dict(http_port=0, served_model_name="tiny",
                                                                       **rollout),
                               server={"auth_token": token} if token else {})
    mesh, port, replica = await start(settings, "127.0.0.1:0")
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{replica.http_port}/v1", api_key=token or "none",
                                max_retries=0, timeout=60)
    try:
        yield client, replica.engine
    finally:
        await client.close()
        await mesh.stop(0)
        await replica.close()


def test_models_lists_the_served_model(model_dir):
    async def main():
        async with http_replica(model_dir) as (client, _):
            listed, one = await client.models.list(), await client.models.retrieve("tiny")
            with pytest.raises(openai.NotFoundError) as unknown:
                await client.models.retrieve("gpt-4o")
            with pytest.raises(openai.NotFoundError) as no_route:       # a route this server lacks: JSON too
                await client.embeddings.create(model="tiny", input="1+1=")
            return listed, one, unknown.value, no_route.value

    models, one, unknown, no_route = asyncio.run(main())
    assert [m.id for m in models.data] == ["tiny"]
    assert (one.id, one.object) == ("tiny", "model")
    assert unknown.body["code"] == "model_not_found" and "'gpt-4o' does not exist" in unknown.body["message"]
    assert no_route.body["message"] == "POST /v1/embeddings: Not Found on this server"


def test_completions_return_n_choices_per_prompt_with_raw_logprobs(model_dir):
    async def main():
        async with http_replica(model_dir) as (client, engine):
            resp = await client.completions.create(model="tiny", prompt=["12+3=", "7-2="], n=2, temperature=0.8,
                                                   top_p=0.9, max_tokens=6, logprobs=2, seed=3,
                                                   extra_body={"return_token_ids": True})
            ids = [engine.encode("12+3=")] * 2 + [engine.encode("7-2=")] * 2
            resp_ids = [c.model_extra["token_ids"] for c in resp.choices]
            ref, _ = await engine.logprobs(ids, resp_ids)
            return resp, ref

    resp, ref = asyncio.run(main())
    from services.rollout.testing import char_tokenizer
    tok = char_tokenizer()
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    for c, expected in zip(resp.choices, ref):
        assert c.finish_reason in ("stop", "length")
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) <= 6
        assert c.logprobs.tokens == [tok.decode([t]) for t in c.model_extra["token_ids"]]
        assert max(abs(a - b) for a, b in zip(c.logprobs.token_logprobs, expected)) < 1e-4
        assert all(len(top) == 2 for top in c.logprobs.top_logprobs)
        # The sampled token's log-prob never exceeds the best alternative's.
        assert all(lp <= max(top.values()) + 1e-6 for lp, top in zip(c.logprobs.token_logprobs,
                                                                      c.logprobs.top_logprobs))
    assert resp.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in resp.choices)
    assert resp.usage.prompt_tokens == 6 + 5        # bos + characters


def test_completions_accept_token_ids_and_honour_stop_and_max_tokens(model_dir):
    async def main():
        async with http_replica(model_dir) as (client, _):
            free = await client.completions.create(model="tiny", prompt=[4, 5, 13], temperature=0, max_tokens=10)
            text = free.choices[0].text
            cut = await client.completions.create(model="tiny", prompt=[4, 5, 13], temperature=0, max_tokens=10,
                                                  stop=text[4:6], extra_body={"return_token_ids": True})
            return free, cut

    free, cut = asyncio.run(main())
    assert free.choices[0].finish_reason == "length"
    text = free.choices[0].text
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.find(text[4:6])]
    extra = cut.choices[0].model_extra
    assert extra["prompt_token_ids"] == [4, 5, 13] and extra["weight_version"] == 0
    assert len(extra["token_ids"]) == text.find(text[4:6]) + 2


def test_chat_completions_apply_the_chat_template(model_dir):
    async def main():
        async with http_replica(model_dir) as (client, engine):
            resp = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "1+1="}], n=3, temperature=1.0, max_tokens=5,
                logprobs=True, top_logprobs=1, seed=4, extra_body={"return_token_ids": True})
            return resp, engine

    resp, engine = asyncio.run(main())
    assert len(resp.choices) == 3
    first = resp.choices[0]
    assert first.message.role == "assistant"
    assert first.model_extra["prompt_token_ids"] == engine.encode("<s>u:1+1=\na:", add_special_tokens=False)
    assert len(first.logprobs.content) == len(first.model_extra["token_ids"]) <= 5
    assert all(len(t.top_logprobs) == 1 for t in first.logprobs.content)


def test_streaming_chat_yields_the_content_then_ends(model_dir):
    async def main():
        async with http_replica(model_dir) as (client, _):
            full = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "2+2="}],
                                                        temperature=0, max_tokens=6)
            stream = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "2+2="}],
                                                          temperature=0, max_tokens=6, stream=True)
            chunks = [c async for c in stream]
            return full, chunks

    full, chunks = asyncio.run(main())
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_streams_end_with_the_usage_chunk_that_stream_options_include_usage_asks_for(model_dir):
    # OpenAI: with stream_options.include_usage, a last chunk before [DONE] has no choices and the request's usage
    # (every other chunk's usage is null).
    async def main():
        async with http_replica(model_dir) as (client, _):
            full = await client.completions.create(model="tiny", prompt="2+2=", n=2, temperature=0, max_tokens=6)
            full_chat = await client.chat.completions.create(model="tiny", temperature=0, max_tokens=6,
                                                             messages=[{"role": "user", "content": "2+2="}])
            chat = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "2+2="}],
                                                        temperature=0, max_tokens=6, stream=True,
                                                        stream_options={"include_usage": True})
            text = await client.completions.create(model="tiny", prompt="2+2=", n=2, temperature=0, max_tokens=6,
                                                   stream=True, stream_options={"include_usage": True})
            return (full, [c async for c in text]), (full_chat, [c async for c in chat])

    for full, chunks in asyncio.run(main()):
        assert [len(c.choices) for c in chunks] == [1] * len(full.choices) + [0]
        assert all(c.usage is None for c in chunks[:-1])
        assert chunks[-1].usage == full.usage


# A bad sampling value is named by the request's own key (`param`), not by the gRPC field `sampling.<name>`.
@pytest.mark.parametrize("kwargs, field", [
    (dict(prompt="1+1=", temperature=-1), "temperature"),
    (dict(prompt="1+1=", n=0), "n"),
    (dict(prompt="1+1=", max_tokens=0), "max_tokens"),
    (dict(prompt="1+1=", top_p=1.5), "top_p"),
    (dict(prompt="1+1=", logprobs=21), "logprobs"),                      # completions' k of top log-probs
    (dict(prompt=[4, 999]), "prompts[0].prompt_ids"),
    (dict(prompt="1+1=", echo=True), "echo"),
    (dict(prompt="1+1=", logit_bias={"5": 100}), "logit_bias"),          # not applied: refused, not ignored
    (dict(prompt="1+1=", presence_penalty=0.5), "presence_penalty"),
    (dict(prompt="1+1=", frequency_penalty=-1.0), "frequency_penalty"),
])
def test_bad_completion_requests_are_400_naming_the_field(model_dir, kwargs, field):
    async def main():
        async with http_replica(model_dir) as (client, _):
            with pytest.raises(openai.BadRequestError) as err:
                await client.completions.create(model="tiny", **kwargs)
            # their no-op values pass (clients often send them)
            ok = await client.completions.create(model="tiny", prompt="1+1=", max_tokens=2, logit_bias={},
                                                 presence_penalty=0, frequency_penalty=0.0)
            return err.value, ok

    err, ok = asyncio.run(main())
    assert err.body["param"] == field and err.body["message"].startswith(f"{field}: "), err.body
    assert len(ok.choices) == 1


@pytest.mark.parametrize("kwargs, field", [
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(max_completion_tokens=0), "max_completion_tokens"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
])
def test_bad_chat_requests_are_400_naming_the_key_sent(model_dir, kwargs, field):
    async def main():
        async with http_replica(model_dir) as (client, _):
            with pytest.raises(openai.BadRequestError) as err:
                await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "1+1="}],
                                                     **kwargs)
            return err.value

    err = asyncio.run(main())
    assert err.body["param"] == field and err.body["message"].startswith(f"{field}: "), err.body


def test_an_unknown_model_is_404(model_dir):
    async def main():
        async with http_replica(model_dir) as (client, _):
            with pytest.raises(openai.NotFoundError) as err:
                await client.completions.create(model="gpt-9", prompt="1+1=")
            return err.value

    assert "gpt-9" in str(asyncio.run(main()))


def test_the_http_api_requires_the_bearer_token_when_one_is_set(model_dir):
    async def main():
        async with http_replica(model_dir, token="s3cret") as (client, _):
            ok = await client.models.list()
            bad = client.with_options(api_key="wrong")
            with pytest.raises(openai.AuthenticationError):
                await bad.models.list()
            return ok

    assert asyncio.run(main()).data[0].id == "tiny"
