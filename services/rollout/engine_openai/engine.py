"""The `openai` rollout engine: proxies generation to an external OpenAI-compatible server.

Each prompt becomes one /v1/completions request (n samples, logprobs on), or with `rollout.openai_api: chat`
one /v1/chat/completions request whose user message is the prompt text (the server applies its chat template).
Token ids come from the upstream's `return_token_ids` / `return_tokens_as_token_ids` extensions (vLLM and
meshrl replicas have them; set `rollout.request_token_ids: false` for servers that reject unknown fields, and
the local tokenizer at `model.path` maps tokens back; a chat answer without ids is re-tokenised once, counted in
GetInfo's `rederived_token_ids`). UpdateWeights lands the weights in `rollout.weights_dir` and has the server
reload them through vLLM's weight-update HTTP endpoints (upstream_weights.py); a server
without them reports `weight_updates: none` and on-policy runs refuse it before step 1. ComputeLogProbs is
FAILED_PRECONDITION here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import AsyncIterable, Mapping

from services.common.auto import Resolved
from services.common.errors import FailedPrecondition, NotFound, Unavailable
from services.common.tensors.weights import Manifest
from services.rollout.config import RolloutSettings
from services.rollout.engine_openai.upstream_weights import UpstreamWeights, server_root
from services.rollout.local_model import try_tokenizer
from services.rollout.types import (GenerateBatch, PromptInput, PromptResult, RolloutEngine, SampleResult, SamplingParams,
                                    check_weight_version)

log = logging.getLogger("meshrl.rollout.openai")

TOKEN_ID_PREFIX = "token_id:"


class OpenAIEngine(RolloutEngine):
    """Forwards Generate to `rollout.server_url`; no weights and no gRPC here."""

    def __init__(self, settings: RolloutSettings):
        try:
            import openai
        except ImportError:
            raise ValueError("rollout.engine: 'openai' needs the openai package (pip install openai)") from None

        r = settings.rollout
        if not r.server_url:
            raise ValueError("rollout.server_url: required when rollout.engine is 'openai' (e.g. http://host:8000/v1)")
        self.config = r
        self.server_url = r.server_url
        self.model_path = settings.model.path
        self.tokenizer = try_tokenizer(self.model_path) if os.path.isdir(self.model_path) else None
        self.max_model_len = r.max_model_len
        self.resolved = Resolved("rollout", log)
        self.max_batch_size = self.resolved.pick("rollout.max_batch_size", r.max_batch_size, 64,
                                                 "requests in flight to the upstream server")
        self.weight_version = 0
        self._openai = openai
        api_key = r.api_key.get_secret_value() if r.api_key else "none"
        self.client = openai.AsyncOpenAI(base_url=r.server_url, api_key=api_key, timeout=r.request_timeout_s,
                                         max_retries=r.request_retries)
        self._upstream_model = r.upstream_model
        self.rederived = 0     # chat samples whose ids were re-derived by the local tokenizer
        self.upstream = UpstreamWeights(server_root(r.server_url), r.weights_dir,
                                        {"Authorization": f"Bearer {api_key}"}, r.request_timeout_s)
        log.info("rollout openai engine: proxying %s (model %s)", r.server_url, r.upstream_model or "<first listed>")

    async def refresh(self) -> None:
        await self.upstream.refresh()

    def info(self) -> dict:
        capability, why = self.upstream.capability, self.upstream.why
        return {"engine": "openai", "server_url": self.server_url, "upstream_model": self._upstream_model or "",
                "max_model_len": self.max_model_len or "", "max_batch_size": self.max_batch_size,
                "resolved": self.resolved.json(), "device": "remote", "dtype": "", "openai_api": self.config.openai_api,
                "weight_updates": capability, "weight_updates_why": why, "rederived_token_ids": self.rederived}

    async def close(self) -> None:
        await self.client.close()

    async def update_weights(self, manifest: Manifest, buckets: AsyncIterable[tuple[bytes, int]]) -> dict:
        from services.common.tensors.weight_transport import receive_host

        start = time.perf_counter()
        check_weight_version(manifest.version)
        capability, why = await self.upstream.refresh()
        if capability != "vllm_http":
            raise FailedPrecondition(f"UpdateWeights: this replica proxies {self.server_url} (rollout.engine "
                                     f"'openai'), which cannot take weights: {why}")
        received = await receive_host(manifest, buckets)
        await self.upstream.push(manifest.version, received.tensors)
        self.weight_version = manifest.version
        return {"weight_version": self.weight_version, "num_bytes": received.num_bytes,
                "seconds": time.perf_counter() - start}

    async def logprobs(self, prompts, responses, temperature: float = 1.0):
        raise FailedPrecondition(f"ComputeLogProbs: this replica proxies {self.server_url} (rollout.engine 'openai') "
                                 "and holds no weights to score with")

    async def generate(self, batch: GenerateBatch) -> list[PromptResult]:
        if not batch.prompts:
            raise ValueError("prompts: empty batch")
        for i, p in enumerate(batch.prompts):
            if not p.prompt_ids and not p.text:
                raise ValueError(f"prompts[{i}]: needs prompt_ids or text")
        model = await self._model()
        # Bounded fan-out: one request per prompt, at most max_batch_size in flight.
        gate = asyncio.Semaphore(self.max_batch_size)

        async def one(i: int, p: PromptInput) -> PromptResult:
            async with gate:
                if self.config.openai_api == "chat":
                    return await self._chat(i, p, batch.sampling, model)
                return await self._complete(i, p, batch.sampling, model)

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(batch.prompts))))

    async def _model(self) -> str:
        if self._upstream_model is None:
            models = await self._call("models", self.client.models.list())
            if not models.data:
                raise Unavailable(f"{self.server_url}/models lists no model; set rollout.upstream_model")
            self._upstream_model = models.data[0].id
        return self._upstream_model

    async def _complete(self, i: int, p: PromptInput, s: SamplingParams, model: str) -> PromptResult:
        extra = {"return_token_ids": True, "return_tokens_as_token_ids": True} if self.config.request_token_ids else {}
        prompt: list[int] | str = list(p.prompt_ids) if p.prompt_ids else p.text
        if not p.prompt_ids and not p.add_special_tokens and self.tokenizer is not None:
            # A rendered chat template already has its bos; the upstream would add another to text.
            prompt = list(self.tokenizer(p.text, add_special_tokens=False)["input_ids"])
        resp = await self._call(f"prompts[{i}]", self.client.completions.create(
            model=model, prompt=prompt, n=s.n, temperature=s.temperature,
            top_p=s.top_p, max_tokens=s.max_tokens, stop=s.stop or None, seed=s.seed,
            logprobs=max(1, s.top_logprobs), extra_body=extra or None))
        choices = sorted(resp.choices, key=lambda c: c.index)
        if len(choices) != s.n:
            raise Unavailable(f"prompts[{i}]: {self.server_url} answered {len(choices)} choices for n={s.n}")
        samples = [self._sample(i, c, s) for c in choices]
        prompt_ids = (choices[0].model_extra or {}).get("prompt_token_ids") or (prompt if isinstance(prompt, list)
                                                                                 else [])
        if not prompt_ids and self.tokenizer is not None:
            prompt_ids = list(self.tokenizer(p.text, add_special_tokens=p.add_special_tokens)["input_ids"])
        return PromptResult(prompt_id=p.id, prompt_ids=list(prompt_ids), samples=samples)

    def _sample(self, i: int, c, s: SamplingParams) -> SampleResult:
        lp = c.logprobs
        if lp is None or lp.token_logprobs is None:
            raise Unavailable(f"prompts[{i}]: {self.server_url} returned no logprobs")
        extra = c.model_extra or {}
        ids = extra.get("token_ids") or [self._token_id(t, i) for t in lp.tokens or []]
        if len(ids) != len(lp.token_logprobs):
            raise Unavailable(f"prompts[{i}]: {len(ids)} token ids but {len(lp.token_logprobs)} logprobs upstream")
        top = None
        if s.top_logprobs and lp.top_logprobs:
            top = [sorted(((self._token_id(t, i), v) for t, v in (step or {}).items()), key=lambda kv: -kv[1])
                   [:s.top_logprobs] for step in lp.top_logprobs]
        return SampleResult(response_ids=[int(t) for t in ids], logprobs=[float(x) for x in lp.token_logprobs],
                            text=c.text, finish_reason="length" if c.finish_reason == "length" else "stop",
                            weight_version=int(extra.get("weight_version", self.weight_version)), top_logprobs=top)

    async def _chat(self, i: int, p: PromptInput, s: SamplingParams, model: str) -> PromptResult:
        if p.prompt_ids or not p.text:
            # Token ids carry a template the caller rendered; the chat API takes messages and renders its own.
            raise ValueError(f"prompts[{i}]: rollout.openai_api 'chat' sends the prompt text as a user message; "
                             "this prompt has token ids only (set data.apply_chat_template: false: the server "
                             "applies its chat template)")
        extra = {"return_token_ids": True, "return_tokens_as_token_ids": True} if self.config.request_token_ids else {}
        messages = [{"role": "user", "content": p.text}]
        resp = await self._call(f"prompts[{i}]", self.client.chat.completions.create(
            model=model, messages=messages, n=s.n, temperature=s.temperature, top_p=s.top_p,
            max_tokens=s.max_tokens, stop=s.stop or None, seed=s.seed, logprobs=True,
            top_logprobs=s.top_logprobs or None, extra_body=extra or None))
        choices = sorted(resp.choices, key=lambda c: c.index)
        if len(choices) != s.n:
            raise Unavailable(f"prompts[{i}]: {self.server_url} answered {len(choices)} choices for n={s.n}")
        # vLLM puts the prompt's ids on the response, meshrl replicas on each choice too.
        prompt_ids = (resp.model_extra or {}).get("prompt_token_ids") or \
            (choices[0].model_extra or {}).get("prompt_token_ids")
        if not prompt_ids:
            prompt_ids = self._rederive(i, lambda tok: tok.apply_chat_template(messages, add_generation_prompt=True,
                                                                               tokenize=True))
        return PromptResult(prompt_id=p.id, prompt_ids=[int(t) for t in prompt_ids],
                            samples=[self._chat_sample(i, c, s) for c in choices])

    def _chat_sample(self, i: int, c, s: SamplingParams) -> SampleResult:
        content = c.logprobs.content if c.logprobs is not None else None
        if content is None:
            raise Unavailable(f"prompts[{i}]: {self.server_url} returned no logprobs")
        extra = c.model_extra or {}
        text = c.message.content or ""
        ids = extra.get("token_ids")
        if not ids and all(e.token.startswith(TOKEN_ID_PREFIX) for e in content):
            ids = [int(e.token[len(TOKEN_ID_PREFIX):]) for e in content]
        if not ids:
            ids = self._rederive(i, lambda tok: tok(text, add_special_tokens=False)["input_ids"])
            eos = self.tokenizer.eos_token_id
            if c.finish_reason == "stop" and len(ids) == len(content) - 1 and eos is not None:
                ids.append(eos)          # the answer's text leaves out the eos it ended with
        if len(ids) != len(content):
            raise Unavailable(f"prompts[{i}]: {len(ids)} token ids but {len(content)} logprobs upstream (enable "
                              "rollout.request_token_ids: the server's own ids keep the two aligned)")
        top = None
        if s.top_logprobs:
            top = [[(self._token_id(t.token, i), float(t.logprob)) for t in (e.top_logprobs or [])][:s.top_logprobs]
                   for e in content]
        return SampleResult(response_ids=[int(t) for t in ids], logprobs=[float(e.logprob) for e in content],
                            text=text, finish_reason="length" if c.finish_reason == "length" else "stop",
                            weight_version=int(extra.get("weight_version", self.weight_version)), top_logprobs=top)

    def _rederive(self, i: int, tokenize) -> list[int]:
        """Ids the upstream did not return, from the local tokenizer (once per prompt or sample, counted)."""
        if self.tokenizer is None:
            raise FailedPrecondition(f"prompts[{i}]: {self.server_url} returned no token ids: enable "
                                     "rollout.request_token_ids or put the model's tokenizer at model.path")
        if self.rederived == 0:
            log.warning("%s returns no token ids: re-deriving them with the local tokenizer (counted in "
                        "GetInfo's rederived_token_ids)", self.server_url)
        self.rederived += 1
        ids = tokenize(self.tokenizer)
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)

    def _token_id(self, token: str, i: int) -> int:
        if token.startswith(TOKEN_ID_PREFIX):
            return int(token[len(TOKEN_ID_PREFIX):])
        if self.tokenizer is not None:
            tid = self.tokenizer.convert_tokens_to_ids(token)
            if tid is not None and tid != self.tokenizer.unk_token_id:
                return int(tid)
        raise FailedPrecondition(f"prompts[{i}]: cannot map upstream token {token!r} to an id: enable "
                                 "rollout.request_token_ids or put the model's tokenizer at model.path")

    async def _call(self, what: str, coro):
        """Upstream errors as meshrl errors: 400/422 -> ValueError, 404 -> NotFound, the rest UNAVAILABLE."""
        oa = self._openai
        try:
            return await coro
        except oa.APIStatusError as e:
            msg = _upstream_message(e)
            if e.status_code in (400, 422):
                raise ValueError(f"{what}: {self.server_url} rejected the request: {msg}") from None
            if e.status_code == 404:
                raise NotFound(f"{what}: {self.server_url}: {msg}") from None
            raise Unavailable(f"{what}: {self.server_url} answered {e.status_code}: {msg}") from None
        except (oa.APIConnectionError, oa.APITimeoutError) as e:
            raise Unavailable(f"{what}: cannot reach {self.server_url}: {e}") from None


def _upstream_message(e) -> str:
    body = getattr(e, "body", None)
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
    return str(e)
