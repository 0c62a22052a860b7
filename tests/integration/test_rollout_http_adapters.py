"""LoRA adapters served as models over the rollout replica's OpenAI-compatible API, as vLLM serves them, driven by
the official `openai` client: `/v1/models` lists the base and each loaded adapter with its version, `model` = an
adapter's name samples under it (log-probs those of the adapter, not the base), and a name not served is
OpenAI's 404 model_not_found naming it, also once the adapter was unloaded."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.test_rollout_http import http_replica
from tests.unit.test_rollout_lora import trained_adapter

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from services.rollout.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("rollout_http_adapters"))


async def _sampled_under(client, engine, model: str, adapter: str):
    """A completion under `model`; its log-probs next to the engine's scoring under `adapter` and the base."""
    resp = await client.completions.create(model=model, prompt="12+3=", n=2, temperature=1.0, max_tokens=6,
                                           logprobs=0, seed=5, extra_body={"return_token_ids": True})
    ids = [c.model_extra["prompt_token_ids"] for c in resp.choices]
    outs = [c.model_extra["token_ids"] for c in resp.choices]
    under, _ = await engine.logprobs(ids, outs, adapter=adapter)
    base, _ = await engine.logprobs(ids, outs)
    return resp, under, base


def test_adapters_are_models_listed_with_their_versions_and_selected_by_name(model_dir):
    tensors, config, _ = trained_adapter(model_dir, seed=1)

    async def main():
        async with http_replica(model_dir, enable_lora=True, max_loras=2, max_lora_rank=8) as (client, engine):
            await engine.apply_adapter("math", 3, config, tensors)
            models = await client.models.list()
            cmpl = await _sampled_under(client, engine, "math", "math")
            base = await _sampled_under(client, engine, "tiny", "math")
            chat = await client.chat.completions.create(model="math", messages=[{"role": "user", "content": "1+1="}],
                                                        max_tokens=4, logprobs=True,
                                                        extra_body={"return_token_ids": True})
            return models, cmpl, base, chat

    models, (cmpl, under, base_lp), (base_resp, _, base_of_base), chat = asyncio.run(main())
    assert [m.id for m in models.data] == ["tiny", "math"]
    assert models.data[1].model_extra["parent"] == "tiny" and models.data[1].model_extra["weight_version"] == 3
    assert models.data[0].model_extra["parent"] is None
    assert cmpl.model == "math" and cmpl.system_fingerprint == "meshrl-v3"
    gap_to_base = 0.0
    for c, want, other in zip(cmpl.choices, under, base_lp, strict=True):
        assert c.model_extra["weight_version"] == 3
        assert c.logprobs.token_logprobs == pytest.approx(want, abs=1e-4)
        gap_to_base = max(gap_to_base, max(abs(a - b) for a, b in zip(c.logprobs.token_logprobs, other)))
    assert gap_to_base > 1e-2             # the adapter changes the policy: a base answer would fail the above
    assert base_resp.model == "tiny"
    for c, want in zip(base_resp.choices, base_of_base, strict=True):
        assert c.logprobs.token_logprobs == pytest.approx(want, abs=1e-4)
    assert chat.model == "math" and chat.choices[0].model_extra["weight_version"] == 3


def test_a_model_not_served_is_a_404_model_not_found_naming_it_also_after_unload(model_dir):
    tensors, config, _ = trained_adapter(model_dir, seed=2)

    async def main():
        async with http_replica(model_dir, enable_lora=True) as (client, engine):
            await engine.apply_adapter("math", 1, config, tensors)
            with pytest.raises(openai.NotFoundError) as unknown:
                await client.completions.create(model="gpt-9", prompt="1+1=", max_tokens=2)
            assert await engine.remove_adapter("math")
            with pytest.raises(openai.NotFoundError) as gone:
                await client.chat.completions.create(model="math", messages=[{"role": "user", "content": "1+1="}])
            return unknown.value, gone.value, await client.models.list()

    unknown, gone, models = asyncio.run(main())
    assert unknown.status_code == 404 and unknown.body["code"] == "model_not_found"
    assert unknown.body["param"] == "model" and unknown.body["type"] == "invalid_request_error"
    assert "'gpt-9' does not exist" in unknown.body["message"] and "'math'" in unknown.body["message"]
    assert "'math' does not exist" in gone.body["message"]
    assert [m.id for m in models.data] == ["tiny"]
