"""Proxy mode: an unmodified agent program talks to the rollout HTTP API at `/sessions/<session_id>/v1`, and the
replica records its calls as a token-exact trajectory under that session id (docs/agentic.md, "Proxy mode").

Per session the replica keeps, segment by segment, the prompt ids it rendered and every id after them: the ids it
sampled (mask 1, with their log-probs and weight version) and the observation ids between turns (mask 0). A chat
request whose messages repeat the segment's history (the messages sent so far and the answer the replica gave)
and add new ones (tool results, a user turn) continues the segment: its prompt is the segment's ids plus the chat
template's delta for the new messages (`services.common.chat_delta.observation_ids`), so the conversation is never
re-tokenised whole. A request that does not (the agent rewrote or dropped history, changed its tools, or the
template cannot append turns token-exact) starts a new segment, recorded with the reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

from services.common.chat_delta import observation_ids
from services.common.errors import NotFound
from services.common.tool_calls import tool_call_from_openai
from services.rollout.agents.function_calling import render_messages, template_turns
from services.rollout.types import AgentLimits, GenerateBatch, PromptInput, PromptResult, SampleResult, SamplingParams

# Live sessions one replica keeps at most (the least recently used is dropped past it), and how long an untouched
# session is kept.
MAX_SESSIONS = 4096
SESSION_TTL_S = 3600.0
SESSION_ID = re.compile(r"[A-Za-z0-9._~-]{1,128}")


@dataclass
class Segment:
    """One token-exact stretch of a session: a rendered prompt, then sampled and observation ids."""

    prompt_ids: list[int]
    started_because: str               # first request | history diverged | tools changed | <template error>
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    num_turns: int = 0
    num_tool_calls: int = 0
    finish_reason: str = ""
    # What a continuing request repeats: the messages so far and the last answer, normalised; the tools offered.
    history: list[str] = field(default_factory=list)
    tools_key: str = ""
    end_text: str = ""                 # the text of the special token that ended the last answer ("" = none)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def add_observation(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.weight_versions += [-1] * len(ids)

    def add_sampled(self, sample: SampleResult) -> None:
        n = len(sample.response_ids)
        versions = sample.weight_versions if sample.weight_versions and len(sample.weight_versions) == n \
            else [sample.weight_version] * n
        self.response_ids += sample.response_ids
        self.logprobs += list(sample.logprobs)
        self.loss_mask += [1] * n
        self.weight_versions += list(versions)
        self.num_turns += 1
        self.finish_reason = sample.finish_reason

    def to_json(self) -> dict:
        return {"prompt_ids": self.prompt_ids, "response_ids": self.response_ids, "logprobs": self.logprobs,
                "loss_mask": self.loss_mask, "weight_versions": self.weight_versions, "num_turns": self.num_turns,
                "num_tool_calls": self.num_tool_calls, "finish_reason": self.finish_reason,
                "started_because": self.started_because}


@dataclass
class Plan:
    """How one request's prompt is built: the ids to generate from, and the segment it continues (None = new)."""

    prompt_ids: list[int]
    observation_ids: list[int]
    segment: Segment | None
    reason: str = ""


@dataclass
class Session:
    """One agent's trajectory on this replica. Requests of a session run one at a time (its lock)."""

    session_id: str
    segments: list[Segment] = field(default_factory=list)
    # Set by a session the replica opens for its own episode (the openai_agent loop): the run's sampling (its
    # temperature, top_p and seed win over the agent's) and the episode limits. None: the request's, no limits.
    sampling: SamplingParams | None = None
    limits: AgentLimits | None = None
    partial_rollout: str = "off"        # the openai_agent episode's (GenerateEpisodesRequest.partial_rollout)
    # Why the session refuses further turns ("" = it does not): max_turns or length.
    ended: str = ""
    num_requests: int = 0
    touched: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def num_turns(self) -> int:
        return sum(s.num_turns for s in self.segments)

    @property
    def kv_id(self) -> str:
        """The episode id the engine keeps this session's KV under (PromptInput.episode_id)."""
        return f"session:{self.session_id}"

    def plan(self, messages: list, tools: list[dict], prefix: str, tokenizer) -> Plan:
        """The prompt of a chat request in this session: the last segment continued when the messages repeat its
        history and add to it, else a new segment with the whole chat rendered."""
        history = [_normal(m, i) for i, m in enumerate(messages)]
        tools_key = json.dumps(tools, sort_keys=True)
        prefix_ids = list(tokenizer.encode(prefix, add_special_tokens=False)) if prefix else []
        last = self.segments[-1] if self.segments else None
        reason = "first request"
        if last is not None:
            n = len(last.history)
            if tools_key != last.tools_key:
                reason = "tools changed"
            elif len(history) <= n or history[:n] != last.history:
                reason = "history diverged"
            else:
                flat, native = template_turns(messages[n:], tokenizer, offset=n)
                try:
                    delta = observation_ids(tokenizer, flat, end_text=last.end_text,
                                            tools=tools if tools and native else None)
                except ValueError as e:   # the template re-renders earlier turns: no token-exact append
                    reason = str(e)
                else:
                    obs = delta + prefix_ids
                    return Plan(last.ids + obs, obs, last)
        ids = list(tokenizer.encode(render_messages(messages, tools, tokenizer), add_special_tokens=False))
        return Plan(ids + prefix_ids, [], None, reason)

    async def play_turn(self, engine, messages: list, calling, sampling: SamplingParams) -> list[PromptResult]:
        """One chat request of this session (hold its lock): the prompt planned, one answer generated from its ids
        and recorded. `calling` is the request's FunctionCalling."""
        if sampling.n != 1:   # the HTTP API refuses it before a session opens; a direct caller gets the same
            raise ValueError(f"n: a session records one answer per request, got {sampling.n}")
        if self.ended:
            raise ValueError(f"session {self.session_id!r}: ended ({self.ended}); no more turns")
        if self.limits is not None and self.num_turns >= self.limits.max_turns:
            self.ended = "max_turns"
            raise ValueError(f"session {self.session_id!r}: max_turns ({self.limits.max_turns}) reached")
        plan = self.plan(messages, calling.tools, calling.prefix, engine.tokenizer)
        limit = getattr(engine, "max_model_len", None)
        if limit and len(plan.prompt_ids) >= limit:
            if self.limits is not None:
                self.ended = "length"
            raise ValueError(f"messages: the session's prompt is {len(plan.prompt_ids)} tokens; the model takes "
                             f"{limit} at most")
        prompt = PromptInput(id=self.session_id, prompt_ids=plan.prompt_ids, episode_id=self.kv_id)
        results = await engine.generate(GenerateBatch([prompt], self._sampling(sampling, plan),
                                                      partial_rollout=self.partial_rollout))
        sample = results[0].samples[0]
        answer, _ = calling.message(sample.text)
        self.record(plan, sample, messages, answer, calling.tools, engine.tokenizer)
        self.num_requests += 1
        return results

    def _sampling(self, asked: SamplingParams, plan: Plan) -> SamplingParams:
        """The request's sampling, with the run's temperature, top_p and seed and the episode's token limits when
        the replica opened this session for an episode."""
        if self.sampling is None or self.limits is None:
            return asked
        used = len(plan.segment.response_ids) + len(plan.observation_ids) if plan.segment else 0
        left = self.limits.max_total_tokens - used
        if left <= 0:
            self.ended = "length"
            raise ValueError(f"session {self.session_id!r}: max_total_tokens ({self.limits.max_total_tokens}) "
                             f"reached")
        s = self.sampling
        # The run's adapter too: the agent's own requests name none (proxy mode), the run's episode samples under it.
        return dataclasses.replace(asked, temperature=s.temperature, top_p=s.top_p, seed=s.seed, adapter=s.adapter,
                                   max_tokens=min(asked.max_tokens, self.limits.max_tokens_per_turn, left))

    def record(self, plan: Plan, sample: SampleResult, messages: list, answer: dict, tools: list[dict],
               tokenizer) -> Segment:
        """Adds one answered request to the session: the observation ids and the sampled ids, token-exact."""
        seg = plan.segment
        if seg is None:
            seg = Segment(prompt_ids=plan.prompt_ids, started_because=plan.reason)
            self.segments.append(seg)
        else:
            seg.add_observation(plan.observation_ids)
        seg.add_sampled(sample)
        seg.num_tool_calls += len(answer.get("tool_calls") or [])
        seg.history = [_normal(m, i) for i, m in enumerate([*messages, answer])]
        seg.tools_key = json.dumps(tools, sort_keys=True)
        last = sample.response_ids[-1] if sample.response_ids else None
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        seg.end_text = tokenizer.decode([last]) if sample.finish_reason == "stop" and last in special else ""
        return seg

    def to_json(self) -> dict:
        return {"session_id": self.session_id, "num_requests": self.num_requests, "num_turns": self.num_turns,
                "ended": self.ended, "segments": [s.to_json() for s in self.segments]}


class SessionStore:
    """The sessions of one replica, by id; the least recently used goes past MAX_SESSIONS, idle ones after the TTL."""

    def __init__(self, *, max_sessions: int = MAX_SESSIONS, ttl_s: float = SESSION_TTL_S,
                 on_end: Callable[[str], None] | None = None):
        self.max_sessions, self.ttl_s = max_sessions, ttl_s
        self._sessions: dict[str, Session] = {}
        # Told each session's kv_id when it goes (dropped, forgotten, expired, pushed out): engine.end_episode.
        self.on_end = on_end

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, session_id: str, *, sampling: SamplingParams | None = None,
             limits: AgentLimits | None = None, partial_rollout: str = "off") -> Session:
        """The session of this id, made when it does not exist yet (a user's agent picks its own id)."""
        check_session_id(session_id)
        self._expire()
        session = self._sessions.pop(session_id, None)
        if session is None:
            session = Session(session_id, sampling=sampling, limits=limits, partial_rollout=partial_rollout)
            while len(self._sessions) >= self.max_sessions:
                self._ended(self._sessions.pop(next(iter(self._sessions))))
        session.touched = time.monotonic()
        self._sessions[session_id] = session     # most recently used last
        return session

    def get(self, session_id: str) -> Session:
        self._expire()
        session = self._sessions.get(session_id)
        if session is None:
            raise NotFound(f"session {session_id!r}: no such session on this replica (it never made a request "
                           f"here, ended, or was idle past {self.ttl_s:g}s)")
        return session

    def drop(self, session_id: str) -> Session:
        session = self.get(session_id)
        del self._sessions[session_id]
        self._ended(session)
        return session

    def forget(self, session_id: str) -> None:
        """Drops a session if it is still here (its episode is over)."""
        session = self._sessions.pop(session_id, None)
        if session is not None:
            self._ended(session)

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        for key in [k for k, s in self._sessions.items() if s.touched < cutoff]:
            self._ended(self._sessions.pop(key))

    def _ended(self, session: Session) -> None:
        if self.on_end is not None:
            self.on_end(session.kv_id)


def check_session_id(session_id: str) -> str:
    if not SESSION_ID.fullmatch(session_id):
        raise ValueError(f"session id: {session_id[:140]!r} must be 1-128 characters of A-Z a-z 0-9 . _ ~ -")
    return session_id


def _normal(message: Any, i: int) -> str:
    """A message as a comparable string: role, text content, tool calls (name and parsed arguments); ids, names
    and extra keys a client echoes back (refusal, audio, ...) do not count."""
    if not isinstance(message, dict) or "role" not in message:
        raise ValueError(f"messages[{i}]: needs a role")
    content = message.get("content") or ""
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    calls = [tool_call_from_openai(c, f"messages[{i}].tool_calls[{j}]")
             for j, c in enumerate(message.get("tool_calls") or [])]
    return json.dumps([message["role"], content, [[c.name, c.arguments] for c in calls]], sort_keys=True)


# ---- where the replica's own HTTP API is, for the openai_agent loop in the same process


@dataclass
class ProxyEndpoint:
    """The replica's HTTP API as an agent in the same process reaches it, and its session store."""

    sessions: SessionStore
    base_url: str = ""                 # http://host:port (the API's root; sessions live under /sessions/<id>/v1)
    api_key: str = "none"              # the bearer token the API wants (server.auth_token), "none" without one


_ENDPOINTS: "weakref.WeakKeyDictionary[Any, ProxyEndpoint]" = weakref.WeakKeyDictionary()


def endpoint_for(engine) -> ProxyEndpoint:
    """The session store and API address of an engine's HTTP API (made when the API starts)."""
    endpoint = _ENDPOINTS.get(engine)
    if endpoint is None:
        endpoint = _ENDPOINTS[engine] = ProxyEndpoint(SessionStore(on_end=_episode_ender(engine)))
    return endpoint


def _episode_ender(engine) -> Callable[[str], None] | None:
    """engine.end_episode, held weakly (the endpoints are keyed weakly by their engine)."""
    if not hasattr(engine, "end_episode"):
        return None
    method = weakref.WeakMethod(engine.end_episode)

    def end(kv_id: str) -> None:
        fn = method()
        if fn is not None:
            fn(kv_id)
    return end


def serving_endpoint(engine) -> ProxyEndpoint:
    """endpoint_for, for a caller that needs the API to be up; ValueError naming the key that turns it on."""
    endpoint = _ENDPOINTS.get(engine)
    if endpoint is None or not endpoint.base_url:
        raise ValueError("rollout.http_port: the openai_agent loop runs its agent program against this replica's "
                         "HTTP API, which is off; set rollout.http_port (0 = any free port)")
    return endpoint
