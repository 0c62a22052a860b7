"""The built-in agent loops (episodes.AGENT_LOOPS): one model turn (single_turn), a model that
calls tools through the env replicas (tool_agent), and a model acting in a text environment (env_agent).

Each turn's ids are recorded as sampled and each observation as the chat template's delta (EpisodeRecorder), so an
episode is token-exact; a loop only decides what to observe and when to stop.
"""

from __future__ import annotations

import logging

from services.common.tool_calls import ParsedText
from services.rollout.agents.env_client import EnvLost
from services.rollout.agents.episodes import Episode, EpisodeContext, EpisodeRecorder
from services.rollout.types import PromptInput, SampleResult, SamplingParams

log = logging.getLogger("meshrl.rollout.episodes")


def _turn_end(sample: SampleResult) -> str:
    """A turn that asks for nothing more ends the episode: an answer, or cut at a length limit."""
    return "length" if sample.finish_reason == "length" else "answer"


async def single_turn(ctx: EpisodeContext, prompt: PromptInput, sampling: SamplingParams) -> Episode:
    """Today's Generate as an episode: one turn, every token the model's."""
    rec = ctx.recorder(ctx.prompt_ids(prompt))
    budget = ctx.budget(rec)
    if budget < 1:
        return rec.finish("length", ctx.tokenizer)
    sample = await ctx.generate(rec.context_ids, max_tokens=budget)
    rec.add_sampled(sample)
    return rec.finish(_turn_end(sample), ctx.tokenizer)


async def run_tools(ctx: EpisodeContext, parsed: ParsedText, rec: EpisodeRecorder) -> list[tuple[str, str, bool]]:
    """Runs a turn's calls through the env pool: (call id, observation text, failed) per call, malformed ones first
    as error observations the model reads."""
    out = [(f"malformed_{i}", f"Error: {err}", True) for i, err in enumerate(parsed.errors)]
    if parsed.calls:
        async with ctx.batcher.away():
            results = await ctx.env.call_tools(parsed.calls, ctx.episode_id)
        out += [(r.id, r.content if not r.error or r.content else f"Error: {r.error}", bool(r.error))
                for r in results]
    rec.num_tool_calls += len(out)
    rec.num_tool_errors += sum(failed for _, _, failed in out)
    return out


async def tool_agent(ctx: EpisodeContext, prompt: PromptInput, sampling: SamplingParams) -> Episode:
    """Generate a turn; a turn with tool calls gets their results as tool turns and goes on; one without is the
    answer. Ends at max_turns, at max_total_tokens (length), or at a failed call under tool_error_policy end."""
    rec = ctx.recorder(ctx.prompt_ids(prompt))
    while True:
        budget = ctx.budget(rec)
        if budget < 1:
            return rec.finish("length", ctx.tokenizer)
        sample = await ctx.generate(rec.context_ids, max_tokens=budget)
        rec.add_sampled(sample)
        parsed = ctx.parser(sample.text)
        if not parsed.has_calls:
            return rec.finish(_turn_end(sample), ctx.tokenizer)
        if rec.num_turns >= ctx.limits.max_turns:    # no turn left to read the results in
            return rec.finish("max_turns", ctx.tokenizer)
        results = await run_tools(ctx, parsed, rec)
        if ctx.limits.tool_error_policy == "end" and any(failed for _, _, failed in results):
            return rec.finish("tool_error", ctx.tokenizer)
        obs = ctx.observation_ids(ctx.tool_messages([(cid, text) for cid, text, _ in results]), after=sample)
        if len(rec.response_ids) + len(obs) >= ctx.limits.max_total_tokens:
            return rec.finish("length", ctx.tokenizer)
        rec.add_observation(obs)


def reset_kwargs(ctx: EpisodeContext) -> dict:
    """What the environment's Reset gets from the row's `extra_info.tools_kwargs`: verl keys them by tool, so the
    environment's own entry (its `create_kwargs` when given) when there is one, else the whole mapping."""
    mine = ctx.tools_kwargs.get(ctx.environment)
    if isinstance(mine, dict):
        return dict(mine.get("create_kwargs", mine))
    return dict(ctx.tools_kwargs)


def _first_messages(prompt: PromptInput, observation: str) -> list[dict]:
    messages = list(getattr(prompt, "messages", None) or [])
    if not messages:
        text = "\n\n".join(part for part in (prompt.text, observation) if part)
        return [{"role": "user", "content": text}]
    return messages + ([{"role": "user", "content": observation}] if observation else [])


async def env_agent(ctx: EpisodeContext, prompt: PromptInput, sampling: SamplingParams) -> Episode:
    """Reset the environment, then each model turn is an action and the environment's answer the next user turn,
    until it says done (end_reason answer), max_turns or length. The step rewards add up in Episode.env_reward.
    An episode whose env replica is lost is replayed on another (deterministic environments) or ends env_lost."""
    if prompt.prompt_ids and not getattr(prompt, "messages", None) and not prompt.text:
        raise ValueError(f"prompts[{prompt.id or '?'}]: env_agent needs messages_json or text (the environment's "
                         "first observation is added to them)")
    episode = EnvEpisode(ctx)
    try:
        first = await episode.reset()
    except EnvLost as e:
        log.warning("episode %s: %s", ctx.episode_id, e)
        return EpisodeRecorder(ctx.prompt_ids(prompt)).finish("env_lost", ctx.tokenizer)
    rec = ctx.recorder(ctx.render(_first_messages(prompt, first)))
    try:
        return await _env_turns(ctx, episode, rec)
    finally:
        await ctx.env.end(ctx.episode_id)


async def _env_turns(ctx: EpisodeContext, episode: "EnvEpisode", rec: EpisodeRecorder) -> Episode:
    while True:
        budget = ctx.budget(rec)
        if budget < 1:
            return rec.finish("length", ctx.tokenizer)
        sample = await ctx.generate(rec.context_ids, max_tokens=budget)
        rec.add_sampled(sample)
        try:
            step = await episode.step(sample.text)
        except EnvLost as e:
            log.warning("episode %s: %s", ctx.episode_id, e)
            return rec.finish("env_lost", ctx.tokenizer)
        rec.env_reward = (rec.env_reward or 0.0) + step.reward
        rec.env_metrics.update(step.metrics)
        if step.done:
            return rec.finish("answer", ctx.tokenizer)
        if rec.num_turns >= ctx.limits.max_turns:
            return rec.finish("max_turns", ctx.tokenizer)
        obs = ctx.observation_ids([{"role": "user", "content": step.observation}], after=sample)
        if len(rec.response_ids) + len(obs) >= ctx.limits.max_total_tokens:
            return rec.finish("length", ctx.tokenizer)
        rec.add_observation(obs)


class EnvDiverged(EnvLost):
    """A replay observed something the episode did not: the environment is not deterministic."""


class EnvEpisode:
    """An environment episode that survives losing its env replica when the environment is deterministic: Reset on
    another replica with the same kwargs and replay the actions; the replayed observations must equal the recorded
    ones, else (or when not deterministic) EnvLost."""

    MAX_REPLAYS = 2

    def __init__(self, ctx: EpisodeContext):
        self.ctx = ctx
        self.kwargs = reset_kwargs(ctx)
        self.first = ""
        self.history: list[tuple[str, str]] = []     # (action, observation) per step so far
        self.lost: set[str] = set()

    async def reset(self) -> str:
        async with self.ctx.batcher.away():
            self.first = await self.ctx.env.reset(self.ctx.episode_id, self.ctx.environment, self.kwargs)
        return self.first

    async def step(self, action: str):
        async with self.ctx.batcher.away():
            return await self._step(action)

    async def _step(self, action: str):
        for attempt in range(self.MAX_REPLAYS + 1):
            try:
                if attempt:
                    await self._replay()
                result = await self.ctx.env.step(self.ctx.episode_id, action)
            except EnvDiverged:
                raise
            except EnvLost:
                if not self.ctx.environment_deterministic:
                    raise
                self.lost.add(self.ctx.env.home(self.ctx.episode_id))
                continue
            self.history.append((action, result.observation))
            return result
        raise EnvLost(f"episode {self.ctx.episode_id}: its env replicas were lost {self.MAX_REPLAYS + 1} times")

    async def _replay(self) -> None:
        """The episode again on another replica, up to the step that was lost."""
        env, eid = self.ctx.env, self.ctx.episode_id
        log.info("episode %s: env replica lost (%s); replaying %d steps elsewhere", eid, sorted(self.lost),
                 len(self.history))
        first = await env.reset(eid, self.ctx.environment, self.kwargs, exclude=frozenset(self.lost))
        if first != self.first:
            raise EnvDiverged(f"episode {eid}: the replayed Reset observed something else (the environment is not "
                          "deterministic; set rollout.agent.environment_deterministic: false)")
        for action, observation in self.history:
            result = await env.step(eid, action)
            if result.observation != observation:
                raise EnvDiverged(f"episode {eid}: a replayed step observed something else (the environment is not "
                              "deterministic; set rollout.agent.environment_deterministic: false)")
