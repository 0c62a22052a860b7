"""The openai_agent loop: an agent program that only knows an OpenAI base_url (the official `openai` client, sync
and async) plays episodes against a real rollout replica (tiny model, gRPC and HTTP on port 0); GenerateEpisodes
answers with the sessions it recorded, token-exact, so the coordinator rewards and trains on them."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from meshrl.v1 import rollout_pb2_grpc
from services.rollout import convert
from services.rollout.config import AgentConfig, RolloutSettings
from services.rollout.servicer import start
from services.rollout.testing import char_tokenizer, make_tiny_model
from services.rollout.types import EpisodePrompt, SamplingParams

openai = pytest.importorskip("openai")

TOOL_RESULT = "408"


def two_turn_agent(base_url: str, row: dict) -> str:
    """A sync agent: asks, feeds a tool result back, asks again; returns its final answer."""
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120)
    messages = list(row["messages"])
    first = client.chat.completions.create(model="any", messages=messages, max_tokens=5, temperature=0.0)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": "call_1", "content": TOOL_RESULT}]
    second = client.chat.completions.create(model="any", messages=messages, max_tokens=5)
    return "final:" + (second.choices[0].message.content or "")


async def async_agent(base_url: str, row: dict, api_key: str) -> None:
    """An async agent that goes on until the replica refuses a turn (the episode's max_turns)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    messages = list(row["messages"])
    try:
        while True:
            answer = await client.chat.completions.create(model="any", messages=messages, max_tokens=4)
            messages += [answer.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": "more"}]
    finally:
        await client.close()


def silent_agent(base_url: str, row: dict) -> str:
    return "I never asked the model"


def _episodes(tmp_path, agent: AgentConfig, *, n: int = 2, http_port: int | None = 0):
    model = make_tiny_model(tmp_path / "model", max_position_embeddings=512)

    async def main():
        settings = RolloutSettings(model={"path": model}, rollout=dict(http_port=http_port, max_tokens=16))
        mesh, port, replica = await start(settings, "127.0.0.1:0")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = rollout_pb2_grpc.RolloutStub(channel)
                prompts = [EpisodePrompt(id="q1", messages=[{"role": "user", "content": "12*34=?"}]),
                           EpisodePrompt(id="q2", text="7+5=?")]
                request = convert.episodes_request_to_pb(prompts, SamplingParams(n=n, max_tokens=16, seed=3), agent)
                response = await stub.GenerateEpisodes(request, timeout=300)
            return convert.episodes_from_pb(response)
        finally:
            await mesh.stop(0)
            await replica.close()

    return asyncio.run(main())


def test_a_sync_openai_client_agent_plays_token_exact_episodes_on_a_real_replica(tmp_path):
    program = "tests.integration.test_openai_agent:two_turn_agent"
    groups = _episodes(tmp_path, AgentConfig(name="openai_agent", program=program, max_turns=4))
    tok = char_tokenizer()
    delta = tok.encode("\nu:<tool_response>\n408\n</tool_response>\na:", add_special_tokens=False)
    assert [g.prompt_id for g in groups] == ["q1", "q2"] and all(len(g.episodes) == 2 for g in groups)
    for g, question in zip(groups, ("12*34=?", "7+5=?")):
        for ep in g.episodes:
            assert ep.prompt_ids == tok.encode(f"<s>u:{question}\na:", add_special_tokens=False)
            assert (ep.num_turns, ep.end_reason, ep.env_metrics) == (2, "length", {"proxy_segments": 1.0})
            # sampled turn 1 (5 tokens: the agent's max_tokens), the template's delta, sampled turn 2
            assert ep.loss_mask == [1] * 5 + [0] * len(delta) + [1] * 5
            assert ep.response_ids[5:5 + len(delta)] == delta
            assert all(lp == 0.0 for lp, m in zip(ep.logprobs, ep.loss_mask) if not m)
            assert all(lp < 0.0 for lp, m in zip(ep.logprobs, ep.loss_mask) if m)
            assert ep.weight_versions == [0 if m else -1 for m in ep.loss_mask]
            assert ep.text.startswith("final:")
    # The run's sampling wins over the agent's temperature 0: the two episodes of a prompt (seeds differ) differ.
    assert any(g.episodes[0].response_ids != g.episodes[1].response_ids for g in groups)


def test_an_async_agent_past_max_turns_ends_its_episode_with_that_reason(tmp_path):
    program = "tests.integration.test_openai_agent:async_agent"
    groups = _episodes(tmp_path, AgentConfig(name="openai_agent", program=program, max_turns=3), n=1)
    for g in groups:
        [ep] = g.episodes
        assert (ep.end_reason, ep.num_turns) == ("max_turns", 3)
        assert ep.loss_mask.count(1) == 3 * 4
        assert ep.text == char_tokenizer().decode(ep.response_ids, skip_special_tokens=True)


@pytest.mark.parametrize("agent, http_port, message", [
    (AgentConfig(name="openai_agent", program="tests.integration.test_openai_agent:two_turn_agent"), None,
     "rollout.http_port: the openai_agent loop runs its agent program against this replica's HTTP API"),
    (AgentConfig(name="openai_agent", program="tests.integration.test_openai_agent:silent_agent"), 0,
     "rollout.agent.program: the agent program made no chat request on its base_url"),
    (AgentConfig(name="openai_agent", program="tests.integration.test_openai_agent:nowhere"), 0,
     "rollout.agent.program: 'tests.integration.test_openai_agent' has no attribute 'nowhere'"),
    (AgentConfig(name="openai_agent"), 0, "rollout.agent.program: the openai_agent loop needs the agent program"),
])
def test_an_agent_that_cannot_run_is_refused_naming_the_key(tmp_path, agent, http_port, message):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        _episodes(tmp_path, agent, n=1, http_port=http_port)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


def answer_agent(base_url: str, row: dict) -> str:
    """The smallest agent program: one chat call, its answer is the episode's text."""
    with openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120) as client:
        answer = client.chat.completions.create(model="arith", messages=row["messages"], max_tokens=6)
    return answer.choices[0].message.content or ""


@pytest.mark.slow
def test_meshrl_up_trains_on_the_episodes_an_agent_program_plays_through_the_proxy(arith_model_path, tmp_path):
    import json
    import os
    import subprocess
    import sys

    from tests.integration.test_up_supervision import REPO

    out = subprocess.run([sys.executable, "-m", "coordinator.cli", "up", "examples/arith/grpo.yaml",
                          "--run-dir", str(tmp_path), "--model.path", arith_model_path,
                          "--rollout.agent.name", "openai_agent",
                          "--rollout.agent.program", "tests.integration.test_openai_agent:answer_agent",
                          "--rollout.http_port", "0", "--rollout.replicas", "1", "--rollout.n", "4",
                          "--run.num_steps", "2", "--run.eval_every", "0", "--data.heldout_size", "8",
                          "--data.rollout_batch_size", "4"],
                         cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "COMPLETED after 2 steps" in out.stdout
    run_dir = next(p for p in tmp_path.iterdir() if p.name.startswith("arith-grpo"))
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "reward_mean" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:   # one model turn per episode, each recorded by the replica's session
        assert m["turns_per_episode"] == 1.0 and m["tool_calls_per_episode"] == 0.0
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 4 * 4
