"""The rollout replica's episode loop against real env replicas (gRPC on port 0): token exactness, limits and end
reasons, malformed calls, a lost env replica, and batching across episodes. A scripted engine chooses the model's
text (what the loop must handle), tokenised by the toolcalc chat tokenizer (a template that renders tools)."""

from __future__ import annotations

import asyncio
import json
import uuid

import grpc
import pytest

from coordinator.recipe.data import row_to_problem
from coordinator.training import remote
from coordinator.training.episodes import episode_metrics, wants_episodes
from examples.toolcalc.chat import build_tokenizer
from meshrl.v1 import rollout_pb2, rollout_pb2_grpc
from services.common.chat_delta import observation_ids
from services.common.config import load_config
from services.common.rpc.registry import Registry
from services.env.config import EnvConfig, EnvSettings
from services.env.servicer import start as start_env
from services.rollout.agents.env_client import EnvClient
from services.rollout.agents.episodes import EpisodePrompt, EpisodeRunner, episode_seed
from services.rollout.config import AgentConfig, RolloutSettings
from services.rollout.convert import agent_from_pb
from services.rollout.servicer import episode_runner
from services.rollout.servicer import start as start_rollout
from services.rollout.types import GenerateBatch, PromptResult, RolloutEngine, SampleResult, SamplingParams

VERSION = 7
SLOW_TOOL_GATE: dict[str, asyncio.Event] = {}


async def slow_tool(key: str = "") -> str:
    """A user tool that answers only when the test opens its gate."""
    await SLOW_TOOL_GATE[key].wait()
    return "slow answer"


def call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


class ScriptedEngine(RolloutEngine):
    """Answers each turn with the text `script(prompt_ids)` chooses, tokenised, ending with the eos (<|end|>) as a
    chat model's turn does; logprob -0.5 per token. Records the rows of every generate call."""

    model_path = "scripted"

    def __init__(self, tokenizer, script):
        self.tokenizer = tokenizer
        self.script = script
        self.calls: list[int] = []      # rows per generate call
        self.sampled: list[list[int]] = []

    async def generate(self, batch: GenerateBatch) -> list[PromptResult]:
        self.calls.append(len(batch.prompts))
        out = []
        for p in batch.prompts:
            text = self.script(self.tokenizer.decode(p.prompt_ids, skip_special_tokens=False))
            if asyncio.iscoroutine(text):
                text = await text
            ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
            finish = "stop"
            if len(ids) > batch.sampling.max_tokens:
                ids, finish = ids[:batch.sampling.max_tokens], "length"
            self.sampled.append(ids)
            out.append(PromptResult("", p.prompt_ids, [SampleResult(ids, [-0.5] * len(ids), self.tokenizer.decode(
                ids, skip_special_tokens=True), finish, VERSION)]))
        return out

    async def logprobs(self, prompts, responses, temperature=1.0):
        raise NotImplementedError

    def info(self) -> dict:
        return {"engine": "scripted", "max_model_len": 4096}

    async def update_weights(self, manifest, buckets):
        raise NotImplementedError


async def env_replicas(num: int, **env):
    """`num` env replicas on port 0: [(server, address)] and a closer."""
    started = [await start_env(load_config(EnvSettings, data={"env": env}), "127.0.0.1:0") for _ in range(num)]

    async def close():
        for mesh, _, engine in started:
            await mesh.stop(0)
            await engine.close()

    return [(mesh, f"127.0.0.1:{port}") for mesh, port, _ in started], close


def runner_for(engine, addresses, **agent) -> EpisodeRunner:
    env = EnvClient.from_section(EnvConfig(servers=addresses))
    return EpisodeRunner(engine, env, AgentConfig(**agent), max_tokens=200)


def play(script, prompts, *, n=1, env_servers=1, env=None, **agent):
    """Runs episodes of `prompts` with a scripted model against real env replicas; (groups, engine)."""
    async def main():
        servers, close = await env_replicas(env_servers, **(env or {}))
        engine = ScriptedEngine(build_tokenizer(), script)
        runner = runner_for(engine, [a for _, a in servers], **agent)
        try:
            return await runner.run(prompts, SamplingParams(n=n, max_tokens=200), runner.defaults), engine
        finally:
            await runner.env.close()
            await close()
    return asyncio.run(main())


def ask(question: str, **kwargs) -> EpisodePrompt:
    return EpisodePrompt(id=question, messages=[{"role": "user", "content": question}], **kwargs)


def test_a_three_turn_episode_is_its_sampled_ids_and_the_templates_observation_ids_exactly():
    turns = iter([call("calculator", expression="12*7"), call("calculator", expression="84+1"), "It is 85."])
    groups, engine = play(lambda _: next(turns), [ask("What is 12*7+1?")], name="tool_agent", max_turns=4)
    ep = groups[0].episodes[0]
    tok = build_tokenizer()
    end = tok.eos_token   # the model sampled it: the template's copy is not repeated
    obs = [observation_ids(tok, [{"role": "tool", "content": c, "tool_call_id": "x"}], end_text=end,
                           tools=None) for c in ("84", "85")]
    s1, s2, s3 = engine.sampled
    assert ep.response_ids == s1 + obs[0] + s2 + obs[1] + s3
    assert ep.loss_mask == [1] * len(s1) + [0] * len(obs[0]) + [1] * len(s2) + [0] * len(obs[1]) + [1] * len(s3)
    assert ep.logprobs == [-0.5 if m else 0.0 for m in ep.loss_mask]
    assert ep.weight_versions == [VERSION if m else -1 for m in ep.loss_mask]
    assert (ep.end_reason, ep.num_turns, ep.num_tool_calls, ep.num_tool_errors) == ("answer", 3, 2, 0)
    assert "<tool_response>\n84\n</tool_response>" in tok.decode(obs[0]) and ep.text.endswith("It is 85.")
    # the prompt was rendered with the tools the env replica hosts (the template names them)
    assert "tools: calculator, python" in tok.decode(ep.prompt_ids)


def test_limits_end_episodes_with_their_reasons():
    always_call = lambda _: call("calculator", expression="1+1")  # noqa: E731
    groups, _ = play(always_call, [ask("loop")], name="tool_agent", max_turns=3)
    assert (groups[0].episodes[0].end_reason, groups[0].episodes[0].num_turns) == ("max_turns", 3)
    groups, _ = play(always_call, [ask("loop")], name="tool_agent", max_turns=50, max_total_tokens=150)
    ep = groups[0].episodes[0]
    assert ep.end_reason == "length" and len(ep.response_ids) <= 150 and ep.num_turns >= 2
    groups, _ = play(lambda _: "x" * 300, [ask("long")], name="tool_agent", max_tokens_per_turn=40)
    assert groups[0].episodes[0].end_reason == "length" and len(groups[0].episodes[0].response_ids) == 40
    groups, _ = play(lambda _: call("search", q="x"), [ask("bad tool")], name="tool_agent",
                     tool_error_policy="end")
    ep = groups[0].episodes[0]
    assert (ep.end_reason, ep.num_tool_calls, ep.num_tool_errors) == ("tool_error", 1, 1)
    groups, _ = play(lambda _: "4", [ask("2+2?")], name="single_turn")
    ep = groups[0].episodes[0]
    assert (ep.end_reason, ep.num_turns, set(ep.loss_mask)) == ("answer", 1, {1})


def test_ready_turns_go_to_the_engine_in_one_call_and_seeded_episodes_of_a_prompt_differ_reproducibly():
    _, engine = play(lambda _: "4", [ask(f"{i}+{i}?") for i in range(4)], n=3, name="single_turn")
    assert engine.calls == [12]      # twelve episodes' turns, one engine call
    seeds = [episode_seed(5, j) for j in range(8)]
    assert len(set(seeds)) == 8 and seeds == [episode_seed(5, j) for j in range(8)] and episode_seed(None, 0) is None


def test_a_malformed_call_becomes_an_error_observation_the_model_reads():
    turns = iter(['<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+</tool_call>', "Sorry."])
    groups, _ = play(lambda _: next(turns), [ask("1+1?")], name="tool_agent")
    ep = groups[0].episodes[0]
    observed = build_tokenizer().decode([t for t, m in zip(ep.response_ids, ep.loss_mask) if m == 0])
    assert "Error: tool_call[0]: not JSON" in observed
    assert (ep.end_reason, ep.num_tool_calls, ep.num_tool_errors, ep.num_turns) == ("answer", 1, 1, 2)


@pytest.mark.parametrize("deterministic", [True, False])
def test_a_killed_env_replica_loses_no_tool_call_and_no_environment_episode(deterministic):
    async def main():
        servers, close = await env_replicas(2)
        tok = build_tokenizer()
        homes = []

        async def script(context: str):
            if context.count("<|assistant|>") == 2 and not homes:   # before the second action: kill its replica
                home = runner.env.home(runner_eids[0])
                homes.append(home)
                await next(m for m, a in servers if a == home).stop(0)
            if "Guess" in context:
                return "50" if context.count("<|assistant|>") == 1 else "25"
            return call("calculator", expression="6*7") if context.count("<|assistant|>") == 1 else "42"

        engine = ScriptedEngine(tok, script)
        runner = runner_for(engine, [a for _, a in servers], name="env_agent", environment="guess_number",
                            max_turns=2, environment_deterministic=deterministic)
        runner_eids = []
        original = runner.env.reset

        async def reset(episode_id, *args, **kwargs):
            runner_eids.append(episode_id)
            return await original(episode_id, *args, **kwargs)

        runner.env.reset = reset
        try:
            kwargs = {"guess_number": {"create_kwargs": {"seed": 3, "low": 1, "high": 100}}}
            envs = await runner.run([ask("Play.", tools_kwargs=kwargs)], SamplingParams(n=1, max_tokens=50),
                                    runner.defaults)
            tools = await runner.run([ask("6*7?")] * 4, SamplingParams(n=2, max_tokens=200),
                                     runner.defaults.model_copy(update={"name": "tool_agent"}))
            return envs, tools, homes
        finally:
            await runner.env.close()
            await close()

    envs, tools, homes = asyncio.run(main())
    ep = envs[0].episodes[0]
    # replayed on the other replica (its second step answered there), or recorded as lost: never dropped
    assert homes and ep.num_turns == 2 and ep.end_reason == ("max_turns" if deterministic else "env_lost")
    assert ep.env_reward == 0.0 and "50 is wrong, go lower" in ep.text
    assert [e.end_reason for g in tools for e in g.episodes] == ["answer"] * 8
    assert all("42" in build_tokenizer().decode(e.response_ids) for g in tools for e in g.episodes)


def test_an_episode_waiting_on_a_slow_tool_does_not_hold_up_the_others():
    SLOW_TOOL_GATE["gate"] = asyncio.Event()
    tool = {"name": "slow", "function": "tests.integration.test_episodes:slow_tool",
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}}}}

    def script(context: str) -> str:
        if "<tool_response>" in context:
            return "done"
        return call("slow", key="gate") if "slow one" in context else call("calculator", expression="2+2")

    async def main():
        servers, close = await env_replicas(1, tools=[tool])
        engine = ScriptedEngine(build_tokenizer(), script)
        runner = runner_for(engine, [a for _, a in servers], name="tool_agent")
        sampling = SamplingParams(n=1, max_tokens=200)
        try:
            slow = asyncio.create_task(runner.run([ask("the slow one")], sampling, runner.defaults))
            fast = await runner.run([ask(f"fast {i}") for i in range(3)], sampling, runner.defaults)
            slow_was_pending = not slow.done()
            SLOW_TOOL_GATE["gate"].set()
            return fast, await slow, slow_was_pending, engine.calls
        finally:
            await runner.env.close()
            await close()

    fast, slow, slow_was_pending, calls = asyncio.run(main())
    assert slow_was_pending
    assert [g.episodes[0].end_reason for g in fast] == ["answer"] * 3
    assert slow[0].episodes[0].end_reason == "answer" and "slow answer" in slow[0].episodes[0].text
    # the fast episodes' first turns went to the engine together; every turn was generated once
    assert max(calls) >= 3 and sum(calls) == 8


def test_bad_agent_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="agent.name: .*unknown agent loop 'no_such_loop'"):
        agent_from_pb(rollout_pb2.AgentSpec(name="no_such_loop"), AgentConfig())
    with pytest.raises(ValueError, match="agent.tool_error_policy"):
        agent_from_pb(rollout_pb2.AgentSpec(tool_error_policy="ignore"), AgentConfig())
    with pytest.raises(ValueError, match="rollout.agent.tools: 'nope' is not hosted by the env replicas"):
        play(lambda _: "x", [ask("q")], name="tool_agent", tools=["nope"])
    with pytest.raises(ValueError, match="prompts.0..agent_name: unknown agent loop 'nope'"):
        play(lambda _: "x", [ask("q", agent_name="nope")])


def test_the_coordinator_gets_episodes_as_samples_with_loss_masks_and_episode_metrics():
    tok = build_tokenizer()
    rows = [{"prompt": [{"role": "user", "content": "What is 6*7?"}], "answer": "42", "agent_name": "tool_agent"},
            {"prompt": [{"role": "user", "content": "Say hi."}], "answer": "hi"}]
    problems = [row_to_problem(r, i, prompt_key="prompt", answer_key="answer", tokenizer=tok)
                for i, r in enumerate(rows)]

    def script(context: str) -> str:
        if "6*7" in context and "<tool_response>" not in context:
            return call("calculator", expression="6*7")
        return "42" if "6*7" in context else "hi"

    async def main():
        servers, close = await env_replicas(1)
        settings = RolloutSettings(model={"path": "scripted"}, env={"servers": [a for _, a in servers]})
        mesh, port, replica = await start_rollout(settings, "127.0.0.1:0", engine=ScriptedEngine(tok, script))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await remote.generate_episodes(rollout_pb2_grpc.RolloutStub(channel), problems, [0, 1],
                                                      SamplingParams(n=2, max_tokens=100), AgentConfig())
        finally:
            await mesh.stop(0)
            await replica.close()
            await close()

    assert wants_episodes(AgentConfig(), problems) and not wants_episodes(AgentConfig(), problems[1:])
    samples = asyncio.run(main())
    assert [s.group for s in samples] == [0, 0, 1, 1] and problems[0].agent_name == "tool_agent"
    tool, plain = samples[0], samples[2]
    assert tool.episode == {"end_reason": "answer", "num_turns": 2, "num_tool_calls": 1, "num_tool_errors": 0}
    assert 0 < int(tool.loss_mask.sum()) < len(tool.response_ids) and tool.finish_reason == "stop"
    assert plain.episode["num_turns"] == 1 and set(plain.loss_mask.tolist()) == {1} and plain.text == "hi"
    assert tool.weight_version == VERSION and tool.weight_versions is None
    assert tok.decode(tool.prompt_ids) == tok.decode(list(problems[0].prompt_ids)).replace(
        "<s>", "<s><|system|>tools: calculator, python<|end|>")
    metrics = episode_metrics(samples)
    assert metrics == {"turns_per_episode": 1.5, "tool_calls_per_episode": 0.5, "tool_error_rate": 0.0,
                       "end_reason/answer": 1.0}


def test_a_rollout_replica_finds_env_replicas_through_the_registry(redis_url):
    prefix = f"test-episodes-{uuid.uuid4().hex[:8]}"
    turns = iter([call("calculator", expression="2*21"), "42"])

    async def main():
        servers, close = await env_replicas(1)
        registry = Registry(redis_url, prefix=prefix)
        await registry.register("env", servers[0][1])
        settings = RolloutSettings(env={"registry": True}, server={"registry_url": redis_url},
                                   run={"redis_prefix": prefix}, rollout={"agent": {"name": "tool_agent"}})
        runner = episode_runner(ScriptedEngine(build_tokenizer(), lambda _: next(turns)), settings)
        try:
            return await runner.run([ask("2*21?")], SamplingParams(max_tokens=100), runner.defaults)
        finally:
            await runner.env.close()
            await registry.deregister("env", servers[0][1])
            await registry.close()
            await close()

    ep = asyncio.run(main())[0].episodes[0]
    assert (ep.end_reason, ep.num_tool_calls, ep.num_tool_errors) == ("answer", 1, 0) and "42" in ep.text
