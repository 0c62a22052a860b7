"""The `openai_agent` loop: an unmodified agent program plays each episode against this replica's own OpenAI-compatible
HTTP API (proxy mode, sessions.py), and the session it recorded becomes the Episode the coordinator
rewards and trains on.

The program is `rollout.agent.program: package.module:function` (or `file.py:function`), sync or async:

    def agent(base_url: str, row: dict) -> str | None

`base_url` is `http://<replica>/sessions/<episode session>/v1`: give it to any OpenAI client as its base URL (the
model name is free; `api_key=` is passed too when the function takes it, for a replica with server.auth_token).
`row` is the prompt: {"id", "messages" (the chat; a user turn of the text when the row has none), "text" (the
prompt ids decoded when the row came tokenised), "tools_kwargs", "episode_id"}. What it returns, a string, is the
text the reward reads; None: the decoded response.

The session uses the run's temperature, top_p and seed (whatever the program asks) and the episode limits: past
`max_turns` or `max_total_tokens` its next request is refused (400), which ends the episode with that end_reason.
The last segment of the session is the episode (a program that rewrote its history started new segments, whose
earlier prompts the model did not read with this one; `env_metrics["proxy_segments"]` counts them).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import logging
from typing import Any

from services.common.plugins import load_object
from services.rollout.agents.sessions import Session, serving_endpoint
from services.rollout.types import Episode, PromptInput, SamplingParams

log = logging.getLogger("meshrl.rollout.openai_agent")
KEY = "rollout.agent.program"


async def openai_agent(ctx, prompt: PromptInput, sampling: SamplingParams) -> Episode:
    """An AgentLoop (episodes.py): the program's chat calls, recorded token-exact, as one episode."""
    if not ctx.program:
        raise ValueError(f"{KEY}: the openai_agent loop needs the agent program (package.module:function)")
    program = load_program(ctx.program)
    endpoint = serving_endpoint(ctx.batcher.engine)
    session_id = f"episode-{ctx.episode_id}"
    session = endpoint.sessions.open(session_id, sampling=sampling, limits=ctx.limits,
                                     partial_rollout=ctx.partial_rollout)
    try:
        answer = await _play(program, f"{endpoint.base_url}/sessions/{session_id}/v1", _row(prompt, ctx),
                             endpoint.api_key, session)
    finally:
        endpoint.sessions.forget(session_id)
    return session_episode(session, ctx.tokenizer, answer)


@functools.lru_cache(maxsize=32)
def load_program(path: str):
    """The program, loaded once per process (a `file.py:function` module is not executed again per episode)."""
    fn = load_object(path, KEY)
    if not callable(fn):
        raise ValueError(f"{KEY}: {path!r} is not callable")
    try:
        sig = inspect.signature(fn)
        sig.bind("http://x/v1", {}, **({"api_key": "none"} if "api_key" in sig.parameters else {}))
    except TypeError as e:
        raise ValueError(f"{KEY}: {path!r} cannot be called as fn(base_url, row) ({e})") from None
    except ValueError:   # a builtin without a signature: its first call says
        pass
    return fn


def _row(prompt: PromptInput, ctx) -> dict[str, Any]:
    """The prompt as the program reads it; a prompt given as ids (a pre-tokenised data row) is decoded to its text,
    which the program sends as a user turn."""
    messages = list(getattr(prompt, "messages", None) or [])
    text = prompt.text
    if not text and prompt.prompt_ids:
        text = ctx.tokenizer.decode(prompt.prompt_ids, skip_special_tokens=True)
    if not messages:
        if not text:
            raise ValueError(f"prompts[{prompt.id or '?'}]: openai_agent needs messages_json, text or prompt_ids "
                             f"(an agent program talks chat)")
        messages = [{"role": "user", "content": text}]
    return {"id": prompt.id, "messages": messages, "text": text,
            "tools_kwargs": dict(getattr(prompt, "tools_kwargs", None) or {}), "episode_id": ctx.episode_id}


async def _play(program, base_url: str, row: dict, api_key: str, session: Session) -> str | None:
    """Runs the program (a sync one in a thread of its own: it blocks on HTTP calls to this very process); its error
    ends the episode when the session refused a turn past a limit, and is the episode's error otherwise."""
    try:
        params = inspect.signature(program).parameters
    except (TypeError, ValueError):
        params = {}
    kwargs = {"api_key": api_key} if "api_key" in params or any(
        p.kind == p.VAR_KEYWORD for p in params.values()) else {}
    try:
        if inspect.iscoroutinefunction(program):
            answer = await program(base_url, row, **kwargs)
        else:
            loop = asyncio.get_running_loop()
            answer = await loop.run_in_executor(_agent_threads(), functools.partial(program, base_url, row, **kwargs))
            if inspect.isawaitable(answer):
                answer = await answer
    except Exception as e:  # noqa: BLE001 - the user's program: a limit it ran into, or its own failure
        if session.ended:
            return None
        raise ValueError(f"{KEY}: {_name(program)} raised {type(e).__name__}: {e}") from None
    if answer is not None and not isinstance(answer, str):
        raise ValueError(f"{KEY}: {_name(program)} returned {type(answer).__name__}; expected a string or None")
    return answer


# Sync programs run in threads of their own: they block on HTTP calls that this process's engine answers, and the
# engine works in the default executor's threads, which blocked programs must not take up.
MAX_AGENT_THREADS = 256
_THREADS: list[concurrent.futures.ThreadPoolExecutor] = []


def _agent_threads() -> concurrent.futures.ThreadPoolExecutor:
    if not _THREADS:
        _THREADS.append(concurrent.futures.ThreadPoolExecutor(MAX_AGENT_THREADS, thread_name_prefix="meshrl-agent"))
    return _THREADS[0]


def _name(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', fn)}"


def session_episode(session: Session, tokenizer, answer: str | None) -> Episode:
    """The session's last segment as an Episode (mask 1 on sampled ids, 0 on the template's delta ids)."""
    if not session.segments:
        raise ValueError(f"{KEY}: the agent program made no chat request on its base_url "
                         f"(session {session.session_id!r})")
    seg = session.segments[-1]
    if len(session.segments) > 1:
        log.info("session %s: %d segments (%s); the episode is the last one", session.session_id,
                 len(session.segments), ", ".join(s.started_because for s in session.segments[1:]))
    end_reason = session.ended or ("length" if seg.finish_reason == "length" else "answer")
    text = answer if answer is not None else tokenizer.decode(seg.response_ids, skip_special_tokens=True)
    return Episode(prompt_ids=list(seg.prompt_ids), response_ids=list(seg.response_ids), logprobs=list(seg.logprobs),
                   loss_mask=list(seg.loss_mask), weight_versions=list(seg.weight_versions), text=text,
                   end_reason=end_reason, num_turns=seg.num_turns, num_tool_calls=seg.num_tool_calls,
                   env_metrics={"proxy_segments": float(len(session.segments))})
