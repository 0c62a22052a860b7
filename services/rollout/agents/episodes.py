"""Multi-turn episodes in the rollout replica: the Episode record, what an agent loop gets (EpisodeContext), the
loops by name (AGENT_LOOPS) and the runner that plays many episodes at once (docs/agentic.md).

An agent loop is an async callable

    async def loop(ctx: EpisodeContext, prompt: PromptInput, sampling: SamplingParams) -> Episode

`prompt` is an `EpisodePrompt` (a PromptInput with the chat `messages`, the row's `agent_name` and `tools_kwargs`);
`sampling` is the request's sampling for one episode (n = 1; a seeded request's seed already made per episode).
What `ctx` offers (one EpisodeContext per episode):

    ctx.tokenizer                  the replica's tokenizer (chat template included)
    ctx.prompt_ids(prompt)         the first prompt's ids: messages rendered with the tools, else ids, else text
    ctx.render(messages)           chat messages -> prompt ids (template applied once, tools included)
    ctx.recorder(prompt_ids)       an EpisodeRecorder (refuses a prompt that leaves the model no room):
        rec.add_sampled(sample)        a turn's ids/logprobs/versions as sampled (mask 1)
        rec.add_observation(ids)       observation ids (mask 0, logprob 0.0, version -1)
        rec.context_ids                prompt + every response token so far (the next turn's prompt)
        rec.num_tool_calls, num_tool_errors, env_reward, env_metrics   counters a loop updates
        rec.finish(end_reason, ctx.tokenizer) -> Episode   (end_reason one of END_REASONS)
    ctx.budget(rec)                new tokens the next turn may take (per-turn, episode and model limits)
    await ctx.generate(ids, max_tokens=None) -> SampleResult
                                   one model turn; the runner gathers the turns that are ready into one engine
                                   generate call per tick, so a loop awaiting a tool holds no one up
    ctx.observation_ids(messages, after=sample)
                                   ids of new messages (tool results, a user turn) plus the next generation prompt,
                                   from the chat template's delta (token-exact; the sampled end token not repeated)
    ctx.tool_messages([(call_id, text), ...])   tool results as the messages this template knows
    ctx.limits                     AgentLimits: max_turns, max_total_tokens, max_tokens_per_turn, tool_error_policy
    ctx.parser                     the tool-call parser (`rollout.agent.tool_call_parser`)
    ctx.tools                      OpenAI tool schemas offered (`rollout.agent.tools`, as the env replicas host them)
    ctx.env                        EnvClient or None: call_tools(calls, episode_id), reset(episode_id, environment,
                                   kwargs), step(episode_id, action), end(episode_id)
    ctx.episode_id, ctx.environment, ctx.environment_deterministic, ctx.tools_kwargs, ctx.max_model_len

A new loop is a function of that shape, one line in AGENT_LOOPS (a LazyLoop("pkg.mod:fn") keeps its imports out of
replicas that never run it) and its name in services.rollout.config.AGENT_NAMES (the config check).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import importlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

from services.common.chat_delta import observation_ids
from services.common.tool_calls import ToolCallParser, load_parser
from services.rollout.agents.env_client import EnvClient
from services.rollout.agents.function_calling import render_messages
from services.rollout.config import AGENT_ALIASES, AgentConfig
from services.rollout.types import (END_REASONS, AgentLimits, Episode, EpisodeGroup, EpisodePrompt,  # noqa: F401
                                    GenerateBatch, PARTIAL_ROLLOUTS, PromptInput, RolloutEngine, SampleResult,
                                    SamplingParams)

log = logging.getLogger("meshrl.rollout.episodes")

AgentLoop = Callable[["EpisodeContext", PromptInput, SamplingParams], Awaitable[Episode]]


class LazyLoop:
    """A loop named by `package.module:function`, imported at its first episode (so a loop's dependencies load only
    where it runs, and a loop module can import this one)."""

    def __init__(self, path: str):
        self.path = path
        self._fn: AgentLoop | None = None

    async def __call__(self, ctx: "EpisodeContext", prompt: PromptInput, sampling: SamplingParams) -> Episode:
        if self._fn is None:
            module, _, attr = self.path.partition(":")
            try:
                self._fn = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as e:
                raise ValueError(f"rollout.agent.name: the loop {self.path!r} cannot be loaded ({e})") from None
        return await self._fn(ctx, prompt, sampling)


# Loops by name (`rollout.agent.name`, a row's `agent_name`; services.rollout.config.AGENT_NAMES lists them for the
# config check). A new loop: a function of the AgentLoop shape, one line here and its name in AGENT_NAMES.
AGENT_LOOPS: dict[str, AgentLoop] = {
    "single_turn": LazyLoop("services.rollout.agents.loops:single_turn"),
    "tool_agent": LazyLoop("services.rollout.agents.loops:tool_agent"),
    "env_agent": LazyLoop("services.rollout.agents.loops:env_agent"),
    "openai_agent": LazyLoop("services.rollout.agents.openai_agent:openai_agent"),
}


def agent_loop(name: str, where: str = "rollout.agent.name") -> AgentLoop:
    """The loop of a name (verl's aliases too); a ValueError naming `where` when unknown."""
    loop = AGENT_LOOPS.get(AGENT_ALIASES.get(name, name))
    if loop is None:
        raise ValueError(f"{where}: unknown agent loop {name!r} (known: {', '.join(AGENT_LOOPS)})")
    return loop


# ---- the record


class EpisodeRecorder:
    """Builds an Episode token-exact: sampled turns as the engine returned them, observation ids from the template's
    delta (mask 0, logprob 0.0, version -1)."""

    def __init__(self, prompt_ids: Sequence[int]):
        self.prompt_ids = list(prompt_ids)
        self.response_ids: list[int] = []
        self.logprobs: list[float] = []
        self.loss_mask: list[int] = []
        self.weight_versions: list[int] = []
        self.num_turns = self.num_tool_calls = self.num_tool_errors = 0
        self.env_reward: float | None = None
        self.env_metrics: dict[str, float] = {}

    @property
    def context_ids(self) -> list[int]:
        """What the next turn is generated from: the prompt and every response token so far."""
        return self.prompt_ids + self.response_ids

    def add_sampled(self, sample: SampleResult) -> None:
        self.num_turns += 1
        self.response_ids += sample.response_ids
        self.logprobs += sample.logprobs
        self.loss_mask += [1] * len(sample.response_ids)
        # partial rollouts tag each token with the version that produced it
        self.weight_versions += (list(sample.weight_versions) if getattr(sample, "weight_versions", None)
                                 else [sample.weight_version] * len(sample.response_ids))

    def add_observation(self, ids: Sequence[int]) -> None:
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.weight_versions += [-1] * len(ids)

    def finish(self, end_reason: str, tokenizer) -> Episode:
        assert end_reason in END_REASONS, end_reason
        text = tokenizer.decode(self.response_ids, skip_special_tokens=True) if tokenizer is not None else ""
        return Episode(prompt_ids=self.prompt_ids, response_ids=self.response_ids, logprobs=self.logprobs,
                       loss_mask=self.loss_mask, weight_versions=self.weight_versions, text=text,
                       end_reason=end_reason, num_turns=self.num_turns, num_tool_calls=self.num_tool_calls,
                       num_tool_errors=self.num_tool_errors, env_reward=self.env_reward,
                       env_metrics=dict(self.env_metrics))


# ---- one engine call per tick


class TurnBatcher:
    """Gathers the turns that are ready into one engine generate call per tick: an episode awaiting a tool has no
    turn queued, so it holds no one up. Turns with different sampling (a turn's token budget, a seeded episode's
    seed) go in concurrent calls of the same tick, which the torch engine decodes as one batch and vLLM batches
    continuously."""

    def __init__(self, engine: RolloutEngine, *, gather_window_s: float = 0.02):
        self.engine = engine
        self._queue: list[tuple[tuple[list[int], str], SamplingParams, str, asyncio.Future]] = []
        self._task: asyncio.Task | None = None
        self.num_calls = 0          # engine generate calls made (tests, metrics)
        self.num_ticks = 0
        # Episodes away on a tool or environment call. Their answers arrive a little apart (an env replica runs a
        # few calls at once); a tick that waits for them (it stops waiting as soon as none is away) takes their
        # turns in one engine call instead of one call per answer. The wait is at most gather_window_s or a quarter
        # of the last engine call, whichever is longer: it costs at most a fraction of the decode it saves. A tool
        # slower than that simply misses this tick.
        self.gather_window_s = gather_window_s
        self._last_call_s = 0.0
        self._away = 0
        self._changed: asyncio.Event | None = None

    @contextlib.asynccontextmanager
    async def away(self):
        """Marks an episode as off on a tool/env call: the next tick may wait a little for its next turn."""
        self._away += 1
        try:
            yield
        finally:
            self._away -= 1
            if self._changed is not None:
                self._changed.set()

    async def _gather(self) -> None:
        """Waits (up to the window) while episodes are away, so turns that are about to be queued join this tick."""
        if self._away == 0 or self.gather_window_s < 0:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(self.gather_window_s, 0.25 * self._last_call_s)
        self._changed = self._changed or asyncio.Event()
        while self._away > 0:
            left = deadline - loop.time()
            if left <= 0:
                return
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                return
            await asyncio.sleep(0)   # the episode that came back queues its turn

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams,
                       partial_rollout: str = "off", episode_id: str = "") -> SampleResult:
        """One turn; `episode_id` tells the engine which episode it continues (the paged KV cache keeps the
        episode's blocks between its turns until engine.end_episode)."""
        future = asyncio.get_running_loop().create_future()
        self._queue.append(((list(prompt_ids), episode_id), sampling, partial_rollout, future))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        return await future

    async def _run(self) -> None:
        while self._queue:
            await asyncio.sleep(0)   # episodes woken by the last tick queue their next turn first
            await self._gather()
            ready, self._queue = self._queue, []
            self.num_ticks += 1
            groups: dict[tuple[str, str], list[tuple[list[int], asyncio.Future]]] = {}
            for ids, sampling, partial, future in ready:
                groups.setdefault((repr(sampling), partial), [sampling, partial, []])[2].append((ids, future))
            await asyncio.gather(*(self._call(*g) for g in groups.values()))

    async def _call(self, sampling: SamplingParams, partial_rollout: str,
                    turns: list[tuple[list[int], asyncio.Future]]) -> None:
        self.num_calls += 1
        start = time.perf_counter()
        try:
            prompts = [PromptInput(prompt_ids=ids, episode_id=ep) for (ids, ep), _ in turns]
            results = await self.engine.generate(GenerateBatch(prompts, sampling, partial_rollout=partial_rollout))
            self._last_call_s = time.perf_counter() - start
        except Exception as e:  # noqa: BLE001 - handed to every episode of the call
            for _, future in turns:
                if not future.done():
                    future.set_exception(e)
            return
        for (_, future), result in zip(turns, results):
            if not future.done():
                future.set_result(result.samples[0])


# ---- what a loop gets


@dataclass
class EpisodeContext:
    """One episode's handle on the replica (see the module docstring)."""

    tokenizer: Any
    batcher: TurnBatcher
    sampling: SamplingParams            # the turn sampling (n = 1); max_tokens is set per turn
    limits: AgentLimits
    parser: ToolCallParser
    tools: list[dict]
    env: EnvClient | None
    episode_id: str
    environment: str = ""
    environment_deterministic: bool = True
    max_model_len: int | None = None
    native_tools: bool = False          # the chat template renders tools and tool turns itself
    tools_kwargs: dict[str, Any] = field(default_factory=dict)
    program: str = ""                   # openai_agent: the agent program, `package.module:function`
    partial_rollout: str = "off"        # GenerateEpisodesRequest.partial_rollout: of every turn's engine call

    def budget(self, rec: EpisodeRecorder) -> int:
        """New tokens the next turn may take: the per-turn limit, what is left of the episode's, and of the model's
        context."""
        left = min(self.limits.max_tokens_per_turn, self.limits.max_total_tokens - len(rec.response_ids))
        if self.max_model_len is not None:
            left = min(left, self.max_model_len - len(rec.prompt_ids) - len(rec.response_ids))
        return left

    async def generate(self, ids: Sequence[int], max_tokens: int | None = None) -> SampleResult:
        """One model turn from `ids` (batched with the other episodes' turns)."""
        sampling = self.sampling
        if max_tokens is not None and max_tokens != sampling.max_tokens:
            sampling = dataclasses.replace(sampling, max_tokens=max_tokens)
        return await self.batcher.generate(list(ids), sampling, self.partial_rollout, self.episode_id)

    def recorder(self, prompt_ids: Sequence[int]) -> EpisodeRecorder:
        """The record of an episode starting at `prompt_ids`; a prompt leaving the model no room is a ValueError."""
        if self.max_model_len is not None and len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompts[{self.episode_id.split('-')[1]}]: {len(prompt_ids)} tokens (chat template and "
                             f"tools applied) leave no room to generate within max_model_len={self.max_model_len}")
        return EpisodeRecorder(prompt_ids)

    def render(self, messages: list[dict]) -> list[int]:
        """Chat messages as prompt ids: the template applied once with the tools (the Hermes tools text in the system
        turn when the template knows no tools), generation prompt added, no second BOS."""
        text = render_messages(messages, self.tools, self.tokenizer)
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        bos = getattr(self.tokenizer, "bos_token_id", None)
        while bos is not None and len(ids) > 1 and ids[0] == bos and ids[1] == bos:   # a template adding it twice
            ids.pop(0)
        return ids

    def prompt_ids(self, prompt: PromptInput) -> list[int]:
        """The first prompt of an episode: its messages rendered with the tools, else its ids, else its text
        tokenized as Generate does."""
        messages = getattr(prompt, "messages", None)
        if messages:
            return self.render(list(messages))
        if prompt.prompt_ids:
            return [int(t) for t in prompt.prompt_ids]
        if prompt.text:
            return list(self.tokenizer(prompt.text, add_special_tokens=prompt.add_special_tokens)["input_ids"])
        raise ValueError(f"prompts[{prompt.id or '?'}]: needs messages_json, prompt_ids or text")

    def observation_ids(self, messages: list[dict], after: SampleResult | None = None) -> list[int]:
        """The ids of `messages` (tool results, an environment's user turn) and the next generation prompt, as the
        template renders them after the model's turn `after` (token-exact; its sampled end token not repeated)."""
        end_text = ""
        if after is not None and after.finish_reason == "stop" and after.response_ids:
            last = after.response_ids[-1]
            if last in set(getattr(self.tokenizer, "all_special_ids", ())):
                end_text = self.tokenizer.decode([last], skip_special_tokens=False)
        return observation_ids(self.tokenizer, messages, end_text=end_text,
                               tools=self.tools if self.native_tools and self.tools else None)

    def tool_messages(self, contents: Sequence[tuple[str, str]]) -> list[dict]:
        """(call id, text) results as the messages the template knows: `tool` turns for a template that renders
        tools, else `<tool_response>` user turns (as the HTTP API's function calling writes them)."""
        if self.native_tools:
            return [{"role": "tool", "content": text, "tool_call_id": cid} for cid, text in contents]
        return [{"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"} for _, text in contents]


# ---- many episodes at once


def episode_seed(seed: int | None, index: int) -> int | None:
    """A seeded request's seed for its episode `index` of a prompt: the n episodes of a prompt differ, each one
    reproducible whatever else shares the batch (the engines seed by seed, prompt ids and sample index)."""
    if seed is None:
        return None
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2 or 1


class EpisodeRunner:
    """Plays GenerateEpisodes requests on one engine: each episode an asyncio task, their turns batched by one
    TurnBatcher shared by every request this replica serves."""

    def __init__(self, engine: RolloutEngine, env: EnvClient | None, defaults: AgentConfig, *,
                 max_tokens: int, tool_call_parser: str = "hermes", env_missing: str = ""):
        self.engine = engine
        self.env = env
        self.defaults = defaults            # the replica's rollout.agent section
        self.max_tokens = max_tokens        # rollout.max_tokens: the per-turn default
        self.tool_call_parser = tool_call_parser   # env.tool_call_parser: the parser default
        self.batcher = TurnBatcher(engine)
        # Why there is no env client ("" = the settings name no env replicas).
        self.env_missing = env_missing

    async def run(self, prompts: Sequence[EpisodePrompt], sampling: SamplingParams, agent: AgentConfig, *,
                  partial_rollout: str = "off") -> list[EpisodeGroup]:
        tokenizer = getattr(self.engine, "tokenizer", None)
        if tokenizer is None:
            raise ValueError("GenerateEpisodes: this replica has no tokenizer (episodes need its chat template)")
        if not prompts:
            raise ValueError("prompts: give at least one prompt")
        if partial_rollout not in PARTIAL_ROLLOUTS:
            raise ValueError(f"partial_rollout: must be one of {', '.join(PARTIAL_ROLLOUTS)}, got {partial_rollout!r}")
        names = [p.agent_name or agent.name or "single_turn" for p in prompts]
        loops = [agent_loop(n, f"prompts[{i}].agent_name" if p.agent_name else "rollout.agent.name")
                 for i, (n, p) in enumerate(zip(names, prompts))]
        kinds = {AGENT_ALIASES.get(n, n) for n in names}
        if kinds & {"tool_agent", "env_agent"} and self.env is None:
            raise ValueError(self.env_missing or f"rollout.agent.name: {sorted(kinds & {'tool_agent', 'env_agent'})[0]}"
                             " needs env replicas: set env.servers, env.dns or env.registry in the rollout replica's "
                             "settings")
        if "env_agent" in kinds and not agent.environment:
            raise ValueError("rollout.agent.environment: env_agent needs the environment's name")
        tools = await self._tools(agent) if "tool_agent" in kinds or "openai_agent" in kinds else []
        base = dict(tokenizer=tokenizer, batcher=self.batcher, tools=tools, env=self.env,
                    limits=agent.limits(self.max_tokens),
                    parser=load_parser(agent.tool_call_parser or self.tool_call_parser),
                    environment=agent.environment or "", environment_deterministic=agent.environment_deterministic,
                    program=agent.program or "", partial_rollout=partial_rollout,
                    max_model_len=self.engine.info().get("max_model_len"),
                    native_tools="tools" in (getattr(tokenizer, "chat_template", None) or "")
                    and "tool_calls" in (getattr(tokenizer, "chat_template", None) or ""))
        run_id = uuid.uuid4().hex[:12]
        tasks = []
        for i, (prompt, loop) in enumerate(zip(prompts, loops)):
            for j in range(sampling.n):
                turn = dataclasses.replace(sampling, n=1, seed=episode_seed(sampling.seed, j))
                ctx = EpisodeContext(sampling=turn, episode_id=f"{run_id}-{i}-{j}",
                                     tools_kwargs=dict(prompt.tools_kwargs), **base)
                tasks.append(asyncio.create_task(self._play(loop, ctx, prompt, turn)))
        try:
            episodes = await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
        n = sampling.n
        return [EpisodeGroup(p.id, list(episodes[i * n:(i + 1) * n])) for i, p in enumerate(prompts)]

    async def _play(self, loop: AgentLoop, ctx: EpisodeContext, prompt: PromptInput, turn: SamplingParams) -> Episode:
        """One episode; whatever way it ends, the engine may let go of the KV it kept for its next turn."""
        try:
            return await loop(ctx, prompt, turn)
        finally:
            end = getattr(self.engine, "end_episode", None)     # RolloutEngine's; a duck-typed engine may lack it
            if end is not None:
                end(ctx.episode_id)

    async def _tools(self, agent: AgentConfig) -> list[dict]:
        """The schemas of the tools offered: `rollout.agent.tools` by name, or every tool the env replicas host."""
        if self.env is None:
            return []
        hosted = await self.env.list_tools()
        if not agent.tools:
            return hosted
        by_name = {t["function"]["name"]: t for t in hosted}
        missing = [n for n in agent.tools if n not in by_name]
        if missing:
            raise ValueError(f"rollout.agent.tools: {missing[0]!r} is not hosted by the env replicas "
                             f"(they host: {', '.join(by_name) or 'none'})")
        return [by_name[n] for n in agent.tools]
