"""The `openai` rollout engine: proxies generation to an external OpenAI-compatible server.

Each prompt becomes one /v1/completions request (n samples, logprobs on). Token ids come from the
upstream's `return_token_ids` / `return_tokens_as_token_ids` extensions (vLLM and meshrl replicas
have them; set `rollout.request_token_ids: false` for servers that reject unknown fields, and the
local tokenizer at `model.path` maps tokens back). The upstream owns its weights, so UpdateWeights
and ComputeLogProbs are FAILED_PRECONDITION here.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import AsyncIterable

from services.common.errors import FailedPrecondition, NotFound, Unavailable
from services.common.weights import Manifest
from services.rollout.config import RolloutSettings
from services.rollout.local_model import try_tokenizer
from services.rollout.types import GenerateBatch, PromptInput, PromptResult, RolloutEngine, SampleResult, SamplingParams

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
        self.weight_version = 0
        self._openai = openai
        api_key = r.api_key.get_secret_value() if r.api_key else "none"
        self.client = openai.AsyncOpenAI(base_url=r.server_url, api_key=api_key, timeout=r.request_timeout_s,
                                         max_retries=r.request_retries)
        self._upstream_model = r.upstream_model
        log.info("rollout openai engine: proxying %s (model %s)", r.server_url, r.upstream_model or "<first listed>")

    def info(self) -> dict:
        return {"engine": "openai", "server_url": self.server_url, "upstream_model": self._upstream_model or "",
                "max_model_len": self.max_model_len or "", "max_batch_size": self.config.max_batch_size,
                "device": "remote", "dtype": ""}

    async def close(self) -> None:
        await self.client.close()

    async def update_weights(self, manifest: Manifest, buckets: AsyncIterable[tuple[bytes, int]]) -> dict:
        raise FailedPrecondition(f"UpdateWeights: this replica proxies {self.server_url} (rollout.engine 'openai') "
                                 "and cannot change its weights; push weights to torch or vllm replicas")

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
        gate = asyncio.Semaphore(self.config.max_batch_size)

        async def one(i: int, p: PromptInput) -> PromptResult:
            async with gate:
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
