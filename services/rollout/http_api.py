"""OpenAI-compatible HTTP API of a rollout replica: /v1/models, /v1/completions, /v1/chat/completions.

Served by aiohttp in the replica's event loop, next to gRPC, over the same engine (so its lock,
weights and version are shared). Request and response shapes follow the OpenAI API; like vLLM it
also understands `return_token_ids` (adds `token_ids` / `prompt_token_ids` to each choice) and
`return_tokens_as_token_ids` (tokens spelled "token_id:N"), which the openai proxy engine relies on.
`stream: true` is answered as server-sent events with one chunk per choice once generation ends. Chat takes
OpenAI's `tools` and `tool_choice` and answers with `tool_calls` (services/rollout/agents/function_calling.py).
LoRA adapters are served as models, as vLLM serves them: `model` = an adapter's name samples under it, `/v1/models`
lists the base and every loaded adapter with its weight version, and an unknown name is a 404 naming it.
Proxy mode: the same chat route under `/sessions/<session_id>/v1` records each session's calls as a token-exact
trajectory, which `GET /sessions/<session_id>` returns (services/rollout/agents/sessions.py).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from pathlib import Path
from typing import Any

from aiohttp import web

from services.common.errors import MeshError, NotFound
from services.rollout.agents.function_calling import FunctionCalling, render_messages
from services.rollout.agents.sessions import Session, check_session_id, endpoint_for
from services.rollout.config import RolloutConfig
from services.rollout.types import GenerateBatch, PromptInput, PromptResult, RolloutEngine, SamplingParams

log = logging.getLogger("meshrl.rollout.http")

HTTP_STATUS = {"FAILED_PRECONDITION": 400, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503,
               "DEADLINE_EXCEEDED": 504}


class ModelNotFound(NotFound):
    """A request's `model` names nothing served here: OpenAI's 404 (code model_not_found)."""


class OpenAIApi:
    """Request handlers; everything model-related is delegated to the engine."""

    def __init__(self, engine: RolloutEngine, *, model_name: str, defaults: RolloutConfig):
        self.engine = engine
        self.model_name = model_name
        self.defaults = defaults
        self.created = int(time.time())
        self.sessions = endpoint_for(engine).sessions

    # ---- routes

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": self._listing()})

    def _listing(self) -> list[dict]:
        """The base model, then each loaded adapter (vLLM's shape: its parent is the base) with its version."""
        max_len = getattr(self.engine, "max_model_len", None)
        base = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "meshrl",
                "root": self.engine.model_path, "parent": None, "max_model_len": max_len,
                "weight_version": self.engine.weight_version}
        adapters = [{"id": name, "object": "model", "created": self.created, "owned_by": "meshrl",
                     "root": name, "parent": self.model_name, "max_model_len": max_len, "weight_version": version}
                    for name, version in sorted(self.engine.loaded_adapters().items())]
        return [base, *adapters]

    async def model(self, request: web.Request) -> web.Response:
        """One model of /v1/models by its id (OpenAI's retrieve)."""
        listing = self._listing()
        wanted = request.match_info["model"]
        found = next((m for m in listing if m["id"] == wanted), None)
        if found is None:
            raise ModelNotFound(f"model: the model {wanted!r} does not exist on this replica (it serves "
                                f"{', '.join(repr(m['id']) for m in listing)})")
        return web.json_response(found)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "weight_version": self.engine.weight_version})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        adapter = self._adapter_of(body)
        _reject_unsupported(body, ("echo", "suffix", "best_of", *UNHONOURED_SAMPLING))
        prompts = _prompts(body.get("prompt"))
        k = _opt_int(body, "logprobs")
        sampling = self._sampling(body, default_max_tokens=16, top_logprobs=k or 0, adapter=adapter,
                                  keys={"top_logprobs": "logprobs"})
        results = await self.engine.generate(GenerateBatch(prompts, sampling))
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        choices = []
        for i, r in enumerate(results):
            for j, s in enumerate(r.samples):
                choice: dict[str, Any] = {"index": i * sampling.n + j, "text": s.text,
                                          "finish_reason": s.finish_reason, "logprobs": None}
                if k is not None:
                    tokens = [self._token(t, as_ids) for t in s.response_ids]
                    offsets, pos = [], 0
                    for t in tokens:
                        offsets.append(pos)
                        pos += len(t)
                    if s.top_logprobs:
                        top = [{self._token(t, as_ids): lp for t, lp in step} for step in s.top_logprobs]
                    else:   # logprobs=0: the sampled token only, as vLLM answers
                        top = [{tok: lp} for tok, lp in zip(tokens, s.logprobs)]
                    choice["logprobs"] = {"tokens": tokens, "token_logprobs": s.logprobs, "text_offset": offsets,
                                          "top_logprobs": top}
                self._add_ids(body, choice, r, s)
                choices.append(choice)
        payload = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                   "model": adapter or self.model_name, "choices": choices, "usage": _usage(results),
                   "system_fingerprint": self._fingerprint(results)}
        if body.get("stream"):
            return await self._stream(request, payload, "text_completion", body)
        return web.json_response(payload)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        calling, sampling = self._chat_request(body)
        text = self._render_chat(body.get("messages"), calling.tools) + calling.prefix
        prompt = PromptInput(id="chat", text=text, add_special_tokens=False)   # the template holds the bos
        results = await self.engine.generate(GenerateBatch([prompt], sampling))
        return await self._chat_answer(request, body, calling, results, sampling.adapter)

    async def session_chat(self, request: web.Request) -> web.StreamResponse:
        """Chat in proxy mode: the answer is recorded in the session's token-exact trajectory."""
        body = await _json_body(request)
        # An agent program knows a base_url, not this replica's model name: any name is this model here.
        calling, sampling = self._chat_request(body, any_model=True)
        messages = body.get("messages")
        self._render_chat(messages, calling.tools)    # the same checks as a plain chat, before the session opens
        if sampling.n != 1:
            raise ValueError(f"n: a session records one answer per request, got {sampling.n}")
        session: Session = self.sessions.open(check_session_id(request.match_info["session_id"]))
        async with session.lock:
            results = await session.play_turn(self.engine, messages, calling, sampling)
        return await self._chat_answer(request, body, calling, results, sampling.adapter)

    async def session_completions(self, request: web.Request) -> web.Response:
        raise ValueError("prompt: a session records chat requests only (its turns are messages); send this "
                         "completion to /v1/completions, outside the session")

    async def session(self, request: web.Request) -> web.Response:
        """GET: a session's trajectory as JSON; DELETE: the same, and the replica forgets the session."""
        session_id = request.match_info["session_id"]
        if request.method == "DELETE":
            return web.json_response(self.sessions.drop(session_id).to_json())
        return web.json_response(self.sessions.get(session_id).to_json())

    def _chat_request(self, body: dict, *, any_model: bool = False) -> tuple[FunctionCalling, SamplingParams]:
        adapter = self._adapter_of(body, any_model=any_model)
        _reject_unsupported(body, ("response_format", *UNHONOURED_SAMPLING))
        calling = FunctionCalling.from_body(body)
        k = _opt_int(body, "top_logprobs") or 0
        if k and not body.get("logprobs"):
            raise ValueError("top_logprobs: needs logprobs: true")
        keys = {"max_tokens": "max_completion_tokens"} if body.get("max_tokens") is None else {}
        return calling, self._sampling(body, default_max_tokens=getattr(self.engine, "max_model_len", None)
                                       or self.defaults.max_tokens, top_logprobs=k, adapter=adapter, keys=keys)

    async def _chat_answer(self, request: web.Request, body: dict, calling: FunctionCalling,
                           results: list[PromptResult], adapter: str) -> web.StreamResponse:
        want_lp = bool(body.get("logprobs"))
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        choices = []
        for j, s in enumerate(results[0].samples):
            message, parsed = calling.message(s.text)
            choice: dict[str, Any] = {"index": j, "message": message, "logprobs": None,
                                      "finish_reason": "tool_calls" if "tool_calls" in message else s.finish_reason}
            if parsed is not None and parsed.errors:   # calls the parser could not read, one line each
                choice["tool_call_errors"] = parsed.errors
            if want_lp:
                content = []
                for step, (t, lp) in enumerate(zip(s.response_ids, s.logprobs)):
                    tok = self._token(t, as_ids)
                    top = s.top_logprobs[step] if s.top_logprobs else []
                    content.append({"token": tok, "logprob": lp, "bytes": list(tok.encode()),
                                    "top_logprobs": [{"token": self._token(i, as_ids), "logprob": v,
                                                      "bytes": list(self._token(i, as_ids).encode())}
                                                     for i, v in top]})
                choice["logprobs"] = {"content": content}
            self._add_ids(body, choice, results[0], s)
            choices.append(choice)
        payload = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                   "model": adapter or self.model_name, "choices": choices,
                   "usage": _usage(results), "system_fingerprint": self._fingerprint(results)}
        if body.get("return_token_ids"):     # where vLLM puts it on a chat answer
            payload["prompt_token_ids"] = results[0].prompt_ids
        if body.get("stream"):
            return await self._stream(request, payload, "chat.completion.chunk", body)
        return web.json_response(payload)

    # ---- vLLM's weight-update routes (rollout.http_weight_updates): an `openai` replica proxying this one
    # pushes weights through them (services/rollout/engine_openai/upstream_weights.py).

    async def is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": False})

    async def pause_or_resume(self, request: web.Request) -> web.Response:
        # Generation and weight swaps already exclude each other under the engine's lock.
        return web.json_response({"status": "paused" if request.path == "/pause" else "resumed"})

    async def collective_rpc(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if body.get("method") != "reload_weights":
            raise ValueError(f"method: only reload_weights is served here, got {body.get('method')!r}")
        path = (body.get("kwargs") or {}).get("weights_path")
        if not isinstance(path, str) or not path:
            raise ValueError("kwargs.weights_path: a folder of safetensors files is required")
        tensors = await asyncio.to_thread(_load_safetensors, path)
        await self.engine.apply_update(self.engine.weight_version, tensors)
        return web.json_response({"results": [None]})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        try:
            version = int(body.get("new_version"))
        except (TypeError, ValueError):
            raise ValueError(f"new_version: must be an integer, got {body.get('new_version')!r}") from None
        self.engine.weight_version = version
        return web.json_response({"success": True, "new_version": str(version)})

    async def weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": str(self.engine.weight_version)})

    # ---- helpers

    def _adapter_of(self, body: dict, *, any_model: bool = False) -> str:
        """The adapter a request's `model` selects ("" = the base model). any_model (proxy mode, where an agent
        program knows a base_url, not this replica's names): a name that is no adapter is the base model."""
        model = body.get("model")
        if model in (None, "", self.model_name, self.engine.model_path):
            return ""
        loaded = self.engine.loaded_adapters()
        if isinstance(model, str) and model in loaded:
            return model
        if any_model:
            return ""
        served = ", ".join(repr(m) for m in [self.model_name, *sorted(loaded)])
        raise ModelNotFound(f"model: the model {model!r} does not exist on this replica (it serves {served})")

    def _fingerprint(self, results: list[PromptResult]) -> str:
        """The weight version that sampled the answer (an adapter's own version under an adapter)."""
        versions = {s.weight_version for r in results for s in r.samples}
        return f"meshrl-v{max(versions) if versions else self.engine.weight_version}"

    def _sampling(self, body: dict, *, default_max_tokens: int, top_logprobs: int, adapter: str = "",
                  keys: dict[str, str] | None = None) -> SamplingParams:
        """The request's sampling; a bad value is named by the key the client sent (`keys`: field -> request key)."""
        keys = keys or {}
        stop = body.get("stop")
        stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise ValueError("stop: must be a string or a list of strings")
        n, temperature = _num(body, "n", int, 1), _num(body, "temperature", float, 1.0)
        top_p, seed = _num(body, "top_p", float, 1.0), _opt_int(body, "seed")
        max_tokens = _num(body, keys.get("max_tokens", "max_tokens"), int, default_max_tokens)
        try:    # checked when made, each field named `sampling.<field>` as the gRPC request spells it
            return SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, stop=stop,
                                  seed=seed, top_logprobs=top_logprobs, adapter=adapter)
        except ValueError as e:
            field, _, why = str(e).removeprefix("sampling.").partition(": ")
            raise ValueError(f"{keys.get(field, field)}: {why}") from None

    def _render_chat(self, messages, tools: list[dict]) -> str:
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages: must be a non-empty list")
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("messages: chat needs a tokenizer, and this replica has none")
        if not getattr(tok, "chat_template", None):
            raise ValueError("messages: the tokenizer has no chat template; use /v1/completions")
        return render_messages(messages, tools, tok)

    def _token(self, token_id: int, as_ids: bool) -> str:
        tok = self.engine.tokenizer
        if as_ids or tok is None:
            return f"token_id:{token_id}"
        return tok.decode([token_id])

    @staticmethod
    def _add_ids(body: dict, choice: dict, result: PromptResult, sample) -> None:
        if body.get("return_token_ids"):
            choice["token_ids"] = sample.response_ids
            choice["prompt_token_ids"] = result.prompt_ids
            choice["weight_version"] = sample.weight_version

    async def _stream(self, request: web.Request, payload: dict, chunk_object: str, body: dict
                      ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        options = body.get("stream_options")
        usage = isinstance(options, dict) and bool(options.get("include_usage"))   # OpenAI's last usage chunk
        head = {k: payload[k] for k in ("id", "created", "model", "system_fingerprint")} | {"object": chunk_object}
        for choice in payload["choices"]:
            chunk_choice = dict(choice)
            if "message" in chunk_choice:
                chunk_choice["delta"] = dict(chunk_choice.pop("message"))
                if "tool_calls" in chunk_choice["delta"]:   # stream deltas number their calls
                    chunk_choice["delta"]["tool_calls"] = [dict(c, index=k) for k, c in
                                                           enumerate(chunk_choice["delta"]["tool_calls"])]
            chunk = dict(head, choices=[chunk_choice], **({"usage": None} if usage else {}))
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if usage:   # stream_options.include_usage: one more chunk, no choices, the whole request's usage
            await resp.write(f"data: {json.dumps(dict(head, choices=[], usage=payload['usage']))}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _load_safetensors(path: str) -> dict:
    import torch
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"kwargs.weights_path: {path!r} holds no *.safetensors file")
    tensors = {k: v for f in files for k, v in load_file(str(f)).items()}
    head, embed = tensors.get("lm_head.weight"), tensors.get("model.embed_tokens.weight")
    if head is not None and embed is not None and torch.equal(head, embed):
        del tensors["lm_head.weight"]          # a tied head spelled out: an update carries it once, as the embedding
    return tensors


def _usage(results: list[PromptResult]) -> dict:
    prompt = sum(len(r.prompt_ids) for r in results)
    completion = sum(len(s.response_ids) for r in results for s in r.samples)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _prompts(prompt) -> list[PromptInput]:
    """OpenAI's prompt forms: a string, strings, a token list, or token lists."""
    if isinstance(prompt, str):
        return [PromptInput(id="0", text=prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [PromptInput(id=str(i), text=p) for i, p in enumerate(prompt)]
        if all(isinstance(t, int) for t in prompt):
            return [PromptInput(id="0", prompt_ids=list(prompt))]
        if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
            return [PromptInput(id=str(i), prompt_ids=list(p)) for i, p in enumerate(prompt)]
    raise ValueError("prompt: must be a string, a list of strings, a list of token ids or a list of such lists")


def _num(body: dict, key: str, kind, default):
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise ValueError(f"{key}: must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    return kind(value)


def _opt_int(body: dict, key: str) -> int | None:
    return None if body.get(key) is None else _num(body, key, int, None)


# Sampling settings of OpenAI's API the engines do not apply: a value that would change the answer is refused, not
# ignored (0 and {} are their no-op defaults, which clients often send).
UNHONOURED_SAMPLING = ("logit_bias", "presence_penalty", "frequency_penalty")


def _reject_unsupported(body: dict, keys) -> None:
    for key in keys:
        if body.get(key):
            raise ValueError(f"{key}: not supported by this server")


async def _json_body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"request body: not JSON ({e})") from None
    if not isinstance(body, dict):
        raise ValueError("request body: must be a JSON object")
    return body


def _error(status: int, message: str, kind: str, code: str | int | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": message.split(":", 1)[0],
                                        "code": status if code is None else code}}, status=status)


def _middlewares(auth_token: str | None):
    expected = f"Bearer {auth_token}" if auth_token else None

    @web.middleware
    async def errors(request: web.Request, handler):
        if expected and request.path != "/health":
            got = request.headers.get("Authorization", "")
            if not hmac.compare_digest(got.encode(), expected.encode()):
                return _error(401, "missing or invalid bearer token", "authentication_error")
        try:
            return await handler(request)
        except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as e:    # a route this server does not have
            return _error(e.status, f"{request.method} {request.path}: {e.reason} on this server",
                          "invalid_request_error")
        except web.HTTPException:
            raise
        except ValueError as e:
            return _error(400, str(e), "invalid_request_error")
        except ModelNotFound as e:    # OpenAI's answer to an unknown model
            return _error(404, str(e), "invalid_request_error", code="model_not_found")
        except MeshError as e:
            return _error(HTTP_STATUS.get(e.status, 500), str(e), e.status.lower())
        except Exception as e:  # noqa: BLE001 - reported as a 500, logged with its traceback
            log.exception("%s failed", request.path)
            return _error(500, f"internal error: {type(e).__name__}: {e}", "internal_error")

    return [errors]


def build_app(engine: RolloutEngine, *, model_name: str, defaults: RolloutConfig,
              auth_token: str | None = None) -> web.Application:
    api = OpenAIApi(engine, model_name=model_name, defaults=defaults)
    app = web.Application(middlewares=_middlewares(auth_token), client_max_size=64 * 1024 * 1024)
    app.add_routes([web.get("/v1/models", api.models), web.get("/v1/models/{model:.+}", api.model),
                    web.get("/health", api.health),
                    web.post("/v1/completions", api.completions), web.post("/v1/chat/completions", api.chat),
                    # proxy mode (services/rollout/agents/sessions.py)
                    web.get("/sessions/{session_id}/v1/models", api.models),
                    web.post("/sessions/{session_id}/v1/chat/completions", api.session_chat),
                    web.post("/sessions/{session_id}/v1/completions", api.session_completions),
                    web.get("/sessions/{session_id}", api.session), web.delete("/sessions/{session_id}", api.session)])
    if defaults.http_weight_updates:
        app.add_routes([web.get("/is_paused", api.is_paused), web.post("/pause", api.pause_or_resume),
                        web.post("/resume", api.pause_or_resume), web.post("/collective_rpc", api.collective_rpc),
                        web.post("/update_weight_version", api.update_weight_version),
                        web.get("/weight_info", api.weight_info)])
    return app


async def start_http(engine: RolloutEngine, *, host: str, port: int, model_name: str, defaults: RolloutConfig,
                     auth_token: str | None = None) -> tuple[web.AppRunner, int]:
    """Starts the API on host:port (0 = any free port); returns the runner (cleanup() stops it) and the port."""
    runner = web.AppRunner(build_app(engine, model_name=model_name, defaults=defaults, auth_token=auth_token),
                           access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # aiohttp exposes the bound port only here
    endpoint = endpoint_for(engine)    # where an agent program in this process (openai_agent) reaches the API
    local = "127.0.0.1" if host in ("0.0.0.0", "", "::") else (f"[{host}]" if ":" in host else host)
    endpoint.base_url, endpoint.api_key = f"http://{local}:{bound}", auth_token or "none"
    log.info("OpenAI-compatible API on http://%s:%d/v1 (model %r)", host, bound, model_name)
    return runner, bound
