"""Rollout engines: n samples per prompt with per-token log-probs, and all-or-nothing weight swaps.

`RolloutEngine` is the interface the servicer talks to; `TorchEngine` runs a Hugging Face causal LM
with its own batched decode loop (left padding, KV cache) so that every sampled token's log-prob is
the raw-model log-prob the trainer will recompute. Other engines (vLLM, OpenAI proxy) live beside it.
"""

from __future__ import annotations

import abc
import asyncio
import hashlib
import logging
import os
import struct
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterable, Literal, Mapping, Sequence

import torch
import torch.nn.functional as F
from pydantic import Field, SecretStr, field_validator

from services.common.config import MeshSettings, ModelConfig, PoolConfig, ServerConfig
from services.common.errors import FailedPrecondition
from services.common.modeling import batched_logprobs, load_causal_lm, load_tokenizer, set_threads, \
    validate_sequences
from services.common.weight_transport import receive_host
from services.common.weights import Manifest, apply_weights, check_against, named_weights

log = logging.getLogger("meshrl.rollout")


class RolloutConfig(PoolConfig):
    """`rollout:` section: the engine and the default sampling settings of a replica."""

    engine: Literal["torch", "vllm", "openai"] = "torch"
    # Defaults for requests that leave a sampling field unset (0 / empty in the proto).
    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(16, ge=1)
    stop: list[str] = Field(default_factory=list)
    seed: int | None = None
    # Rows (prompts x samples) decoded together; larger requests run in several chunks.
    max_batch_size: int = Field(64, ge=1)
    # Prompt + response token limit; None = the model's max_position_embeddings.
    max_model_len: int | None = Field(None, ge=2)
    # Micro-batch token budget of ComputeLogProbs.
    logprobs_token_budget: int = Field(16384, ge=1)
    # OpenAI-compatible HTTP API port (0 = any free port); None = no HTTP API.
    http_port: int | None = Field(None, ge=0, le=65535)
    # engine "openai": base URL of the OpenAI-compatible server to proxy (http://host:port/v1).
    server_url: str | None = None
    # Model name the HTTP API answers to; None = model.path.
    served_model_name: str | None = None
    # engine "openai": model name requested upstream; None = the first one the server's /v1/models lists.
    upstream_model: str | None = None
    # engine "openai": seconds per upstream request, retries of failed ones, and the bearer token
    # the upstream needs (env MESHRL_ROLLOUT__API_KEY).
    request_timeout_s: float = Field(600.0, gt=0)
    request_retries: int = Field(2, ge=0)
    api_key: SecretStr | None = None
    # engine "openai": ask for token ids with vLLM's return_token_ids / return_tokens_as_token_ids
    # (turn off for servers that reject unknown fields; the local tokenizer then maps tokens to ids).
    request_token_ids: bool = True
    # engine "vllm": share of accelerator memory vLLM takes for weights + KV cache; None = 0.9. On CPU it is
    # the share of RAM given to the KV cache alone (None = 0.1), passed to vLLM as an explicit size: vLLM's own
    # CPU reading subtracts the worker's resident memory from the share, which fails on small hosts.
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    # engine "vllm": KV cache size in GiB; overrides gpu_memory_utilization's share for the cache (on CPU the
    # environment variable VLLM_CPU_KVCACHE_SPACE, in GiB, overrides both).
    kv_cache_gib: float | None = Field(None, gt=0)
    # engine "vllm": more vllm.AsyncEngineArgs ({tensor_parallel_size: 2, enforce_eager: false, ...}); they
    # override the ones meshrl sets.
    vllm_engine_args: dict[str, Any] = Field(default_factory=dict)
    # engine "torch" on CUDA: decode unseeded requests without stop strings or top-logprobs with one captured
    # CUDA graph per step over a static KV cache (services/rollout/cuda_decode.py); others use the eager loop.
    cuda_graphs: bool = False
    # With cuda_graphs: torch.compile the decode step's layers first (fewer, fused kernels; compiles at first use).
    cuda_graph_compile: bool = True
    # With cuda_graphs: sample (temperature / greedy, not top-p) with one fused Triton kernel per step
    # (services/rollout/fused_sample.py) instead of torch ops over fp32 copies of the logits.
    cuda_graph_fused_sampler: bool = True
    # With cuda_graphs: attention over each row's filled cache slots only, in one Triton kernel per layer
    # (services/rollout/decode_attention.py), instead of torch ops over the whole length bucket.
    cuda_graph_triton_attention: bool = True

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        return v


class RolloutSettings(MeshSettings):
    model: ModelConfig = ModelConfig()
    rollout: RolloutConfig = RolloutConfig()
    server: ServerConfig = ServerConfig()


# --------------------------------------------------------------------------------------------------
# Requests and results (what convert.py maps the protobuf messages to)


@dataclass
class SamplingParams:
    """How to sample one batch; already resolved against the replica's defaults."""

    n: int = 1
    temperature: float = 1.0     # 0 = greedy
    top_p: float = 1.0           # nucleus mass in (0, 1]
    max_tokens: int = 16         # new tokens per sample
    stop: list[str] = field(default_factory=list)
    seed: int | None = None      # None = unseeded
    top_logprobs: int = 0        # also return the k most likely tokens per step (HTTP API only)


@dataclass
class PromptInput:
    """One prompt: token ids take precedence over text (which needs a tokenizer)."""

    id: str = ""
    text: str = ""
    prompt_ids: list[int] = field(default_factory=list)
    # Text is tokenized with the tokenizer's special tokens (its bos), as vLLM does for completions;
    # a rendered chat template already holds them, so the HTTP chat route turns this off.
    add_special_tokens: bool = True


@dataclass
class GenerateBatch:
    prompts: list[PromptInput]
    sampling: SamplingParams


@dataclass
class SampleResult:
    """One generated sample; logprobs are under the raw model distribution (no temperature/top_p)."""

    response_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str           # "stop" (eos or a stop string) or "length"
    weight_version: int
    # Per step, the top_logprobs most likely (token id, raw log-prob) pairs; None unless asked for.
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class PromptResult:
    prompt_id: str
    prompt_ids: list[int]
    samples: list[SampleResult]


MAX_SAMPLES_PER_PROMPT = 1024


def validate_sampling(p: SamplingParams) -> None:
    """Bad sampling settings are ValueErrors naming the field."""
    if p.n < 1:
        raise ValueError(f"sampling.n: must be >= 1, got {p.n}")
    if p.n > MAX_SAMPLES_PER_PROMPT:
        # Bounded so one request cannot build decode rows until memory runs out.
        raise ValueError(f"sampling.n: at most {MAX_SAMPLES_PER_PROMPT}, got {p.n}")
    if not p.temperature >= 0:  # also catches NaN
        raise ValueError(f"sampling.temperature: must be >= 0, got {p.temperature}")
    if not 0 < p.top_p <= 1:
        raise ValueError(f"sampling.top_p: must be in (0, 1], got {p.top_p}")
    if p.max_tokens < 1:
        raise ValueError(f"sampling.max_tokens: must be >= 1, got {p.max_tokens}")
    if any(s == "" for s in p.stop):
        raise ValueError("sampling.stop: stop strings must not be empty")
    if not 0 <= p.top_logprobs <= 20:
        raise ValueError(f"sampling.top_logprobs: must be in [0, 20], got {p.top_logprobs}")


class RolloutEngine(abc.ABC):
    """What every rollout engine offers the servicer (and the HTTP API)."""

    model_path: str
    weight_version: int = 0
    tokenizer = None

    @abc.abstractmethod
    async def generate(self, batch: GenerateBatch) -> list[PromptResult]:
        """n samples for every prompt, one PromptResult per prompt in order."""

    @abc.abstractmethod
    async def logprobs(self, prompts: list[list[int]], responses: list[list[int]],
                       temperature: float = 1.0) -> tuple[list[list[float]], int]:
        """Per-token log-probs of each response and the weight version that computed them."""

    @abc.abstractmethod
    def info(self) -> dict:
        """Engine, limits, device and dtype for GetInfo."""

    @abc.abstractmethod
    async def update_weights(self, manifest: Manifest, buckets: AsyncIterable[tuple[bytes, int]]) -> dict:
        """Applies a whole update or nothing; returns {weight_version, num_bytes, seconds}."""

    async def apply_update(self, version: int, tensors: Mapping[str, torch.Tensor], *,
                           flat: torch.Tensor | None = None) -> None:
        """Swaps in tensors that arrived whole and checked out (device transports), or raises with the old
        weights kept. Engines that take weights only as a gRPC stream keep this default."""
        raise FailedPrecondition(f"UpdateWeights: the {self.info().get('engine', '?')} engine takes weights over "
                                 "transport grpc only")

    async def close(self) -> None:
        return None


# --------------------------------------------------------------------------------------------------
# Sampling math


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zeroes the tail outside the smallest set of tokens whose mass reaches top_p; [B, V] -> [B, V]."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(-1) - sorted_p
    sorted_p = sorted_p.masked_fill(mass_before >= top_p, 0.0)  # the top token always has mass_before 0
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p)


def sample_tokens(logits: torch.Tensor, *, temperature: float | torch.Tensor, top_p: float | torch.Tensor,
                  generators: Sequence[torch.Generator | None] | None) -> torch.Tensor:
    """Next token per row from fp32 logits [B, V] -> [B]; temperature, top_p and generator may differ per row.

    Rows with temperature 0 are greedy. Sampling is the exponential race argmax(p / Exp(1)) (what
    vLLM does): it draws exactly from p, and with one generator per row a seeded sample does not
    depend on what else is in the batch.
    """
    B, V = logits.shape
    temperature = torch.as_tensor(temperature, dtype=logits.dtype, device=logits.device).expand(B)
    top_p = torch.as_tensor(top_p, dtype=logits.dtype, device=logits.device).expand(B)
    greedy = logits.argmax(-1)
    sampled = temperature > 0
    if not bool(sampled.any()):
        return greedy
    probs = F.softmax(logits / torch.where(sampled, temperature, 1.0).unsqueeze(-1), dim=-1)
    if bool((top_p < 1).any()):
        probs = top_p_filter(probs, top_p.unsqueeze(-1))
    gens = list(generators) if generators is not None else [None] * B
    q = torch.empty_like(probs)
    if any(g is None for g in gens):
        q.exponential_()
    for row, g in enumerate(gens):
        if g is not None and bool(sampled[row]):
            q[row] = torch.empty(V, dtype=probs.dtype).exponential_(generator=g).to(probs.device)
    return torch.where(sampled, (probs / q).argmax(-1), greedy)


def row_generator(seed: int, prompt_ids: Sequence[int], sample_index: int) -> torch.Generator:
    """The generator of one (prompt, sample) row, a hash of the request seed, the prompt and the sample index.

    So a seeded sample does not depend on the prompt's position, the batch, the chunking or on how a
    batch was spread over replicas; the same prompt twice in one seeded request samples the same.
    """
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<qq", seed, sample_index))
    h.update(struct.pack(f"<{len(prompt_ids)}q", *prompt_ids))
    return torch.Generator().manual_seed(int.from_bytes(h.digest(), "little") & (2**63 - 1))


# --------------------------------------------------------------------------------------------------
# The transformers/torch engine


@dataclass
class _Row:
    """Decode state of one (prompt, sample) row, with its request's sampling settings."""

    prompt: list[int]
    budget: int                                   # new tokens this row may produce
    sampling: SamplingParams
    generator: torch.Generator | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    text: str | None = None                       # set when a stop string cut it
    top: list[list[tuple[int, float]]] | None = None


@dataclass
class _Job:
    """One queued Generate request: its validated prompts and the future its caller awaits."""

    batch: GenerateBatch
    prompt_ids: list[list[int]]
    future: asyncio.Future | None


class TorchEngine(RolloutEngine):
    """Generates with a transformers model and a batched KV-cache decode loop; no gRPC here."""

    def __init__(self, settings: RolloutSettings, *, model=None, tokenizer=None):
        m, r = settings.model, settings.rollout
        self.config = r
        self.model_path = m.path
        self.dtype = m.dtype
        self.device = m.device
        set_threads(m.num_threads)
        self.model = model if model is not None else load_causal_lm(m.path, dtype=m.dtype, device=m.device)
        self.model.eval()
        self.tokenizer = tokenizer if tokenizer is not None else _try_tokenizer(m.path)
        cfg = self.model.config
        self.vocab_size = int(cfg.vocab_size)
        self.pad_id = _first_id(cfg.pad_token_id) if cfg.pad_token_id is not None else 0
        self.eos_ids = _eos_ids(self.model, self.tokenizer)
        model_len = getattr(cfg, "max_position_embeddings", None)
        self.max_model_len = int(r.max_model_len or model_len or 2048)
        if model_len and self.max_model_len > model_len:
            raise ValueError(f"rollout.max_model_len: {self.max_model_len} exceeds the model's "
                             f"max_position_embeddings ({model_len})")
        self.weight_version = 0
        # CPU models: the buffer the served weights are views of (after a grpc update), and the one before it.
        self._weights_buffer: torch.Tensor | None = None
        self._spare_buffer: torch.Tensor | None = None
        # One torch job at a time (generation, scoring, weight swap): a swap never lands mid-generation.
        self._locks: dict[asyncio.AbstractEventLoop, asyncio.Lock] = {}
        self._pending: list[_Job] = []
        self.stats = {"requests": 0, "decode_batches": 0, "samples": 0, "generated_tokens": 0}
        self._graph_decoder = None
        if r.cuda_graphs:
            if not str(self.device).startswith("cuda"):
                raise ValueError(f"rollout.cuda_graphs: needs a CUDA device, model.device is {self.device!r}")
            from services.rollout.cuda_decode import GraphDecoder
            self._graph_decoder = GraphDecoder(self.model, pad_id=self.pad_id, eos_ids=sorted(self.eos_ids),
                                               max_batch_size=r.max_batch_size, compile=r.cuda_graph_compile,
                                               fused_sampler=r.cuda_graph_fused_sampler,
                                               triton_attention=r.cuda_graph_triton_attention)
        log.info("rollout torch engine: %s on %s (%s), max_model_len=%d, max_batch_size=%d, tokenizer=%s",
                 self.model_path, self.device, self.dtype, self.max_model_len, r.max_batch_size,
                 "yes" if self.tokenizer is not None else "none")

    @property
    def _lock(self) -> asyncio.Lock:
        """The engine lock of the running event loop (a server has one loop; scripts may run several in turn)."""
        loop = asyncio.get_running_loop()
        lock = self._locks.get(loop)
        if lock is None:
            self._locks = {lp: lk for lp, lk in self._locks.items() if not lp.is_closed()}
            lock = self._locks[loop] = asyncio.Lock()
        return lock

    # ---- RolloutEngine

    def info(self) -> dict:
        return {"engine": "torch", "max_model_len": self.max_model_len, "max_batch_size": self.config.max_batch_size,
                "device": self.device, "dtype": self.dtype, "vocab_size": self.vocab_size,
                "tokenizer": self.tokenizer is not None, **self.stats}

    async def generate(self, batch: GenerateBatch) -> list[PromptResult]:
        prompt_ids = self.resolve_prompts(batch.prompts)   # validate before queueing behind the lock
        validate_sampling(batch.sampling)
        self._check_stop_support(batch.sampling)
        job = _Job(batch, prompt_ids, asyncio.get_running_loop().create_future())
        self._pending.append(job)
        try:
            async with self._lock:
                # Requests that queued while the previous batch ran are decoded together with this one,
                # each row with its own sampling settings; a request already served by such a batch skips.
                if not job.future.done():
                    jobs, self._pending = [j for j in self._pending if not j.future.done()], []
                    await self._run_locked(self._generate_jobs, jobs, on_done=lambda work: _deliver(jobs, work))
        finally:
            if job in self._pending:
                self._pending.remove(job)
        return await job.future

    def generate_sync(self, batch: GenerateBatch) -> list[PromptResult]:
        """generate() for scripts and benchmarks: same checks and decode, in this thread, without the lock."""
        prompt_ids = self.resolve_prompts(batch.prompts)
        validate_sampling(batch.sampling)
        self._check_stop_support(batch.sampling)
        return self._generate_jobs([_Job(batch, prompt_ids, None)])[0]

    async def logprobs(self, prompts, responses, temperature: float = 1.0):
        validate_sequences(prompts, responses, vocab_size=self.vocab_size, max_len=self.max_model_len)
        async with self._lock:
            out = await self._run_locked(batched_logprobs, self.model, prompts, responses, pad_id=self.pad_id,
                                         temperature=temperature, token_budget=self.config.logprobs_token_budget)
            return out, self.weight_version

    async def update_weights(self, manifest: Manifest, buckets: AsyncIterable[tuple[bytes, int]]) -> dict:
        start = time.perf_counter()
        if manifest.version < 0:
            raise ValueError(f"manifest.version: must be >= 0, got {manifest.version}")
        # Every bucket lands CRC-checked in one preallocated buffer (off the event loop) before any weight moves;
        # the buffer the weights lived in before the last swap is that buffer when its size fits. Taken, not
        # shared: an update that runs alongside gets its own.
        spare, self._spare_buffer = self._spare_buffer, None
        try:
            received = await receive_host(manifest, buckets, buffer=spare)
        except BaseException:
            self._spare_buffer = spare
            raise
        await self.apply_update(manifest.version, received.tensors, flat=received.buffer)
        seconds = time.perf_counter() - start
        log.info("weights version %d applied: %d tensors, %.1f MiB in %.2fs", manifest.version,
                 len(received.tensors), received.num_bytes / 2**20, seconds)
        return {"weight_version": self.weight_version, "num_bytes": received.num_bytes, "seconds": seconds}

    async def apply_update(self, version: int, tensors: Mapping[str, torch.Tensor], *,
                           flat: torch.Tensor | None = None) -> None:
        """flat: the CPU buffer every tensor is a view of, which this engine may keep: a CPU model then takes
        the tensors themselves as its weights (no copy) and the buffer of its old weights becomes the spare."""
        if version < 0:
            raise ValueError(f"manifest.version: must be >= 0, got {version}")
        params = named_weights(self.model)
        check_against(tensors, params)
        adopt = flat is not None and flat.device.type == "cpu" and self._graph_decoder is None and all(
            p.device.type == "cpu" for p in params.values())
        def swap_and_tag():
            # Weights and version change in the same worker thread, so a caller cancelled while the swap
            # runs cannot leave new weights under the old version.
            swap_in(self.model, tensors, adopt=adopt)
            if adopt:
                self._spare_buffer, self._weights_buffer = self._weights_buffer, flat
            self.weight_version = version

        async with self._lock:
            await self._run_locked(swap_and_tag)

    async def _run_locked(self, fn, *args, on_done=None, **kwargs):
        """Runs fn in a worker thread; call with the lock held. A thread cannot be interrupted, so when the
        caller is cancelled (a client went away) this still waits for it: the lock is never released
        while torch work runs, and a weight swap never overlaps a generation. on_done(work) runs either way
        (so requests coalesced into a cancelled caller's batch still get their results)."""
        work = asyncio.ensure_future(asyncio.to_thread(fn, *args, **kwargs))
        cancelled = False
        while not work.done():
            try:
                await asyncio.wait({work})
            except asyncio.CancelledError:
                cancelled = True
        if on_done is not None:
            on_done(work)
        if cancelled:
            raise asyncio.CancelledError
        return work.result()

    # ---- input checks

    def resolve_prompts(self, prompts: Sequence[PromptInput]) -> list[list[int]]:
        """Token ids of every prompt (tokenizing text), checked against the vocabulary and max_model_len."""
        if len(prompts) == 0:
            raise ValueError("prompts: empty batch")
        texts: dict[bool, list[int]] = {}      # add_special_tokens -> indices of text prompts
        for i, p in enumerate(prompts):
            if p.prompt_ids:
                bad = [t for t in p.prompt_ids if t < 0 or t >= self.vocab_size]
                if bad:
                    raise ValueError(f"prompts[{i}].prompt_ids: token id {bad[0]} outside the vocabulary "
                                     f"[0, {self.vocab_size})")
            elif p.text:
                if self.tokenizer is None:
                    raise ValueError(f"prompts[{i}].text: this replica has no tokenizer; send prompt_ids")
                texts.setdefault(p.add_special_tokens, []).append(i)
            else:
                raise ValueError(f"prompts[{i}]: needs prompt_ids or text")
        out = [[int(t) for t in p.prompt_ids] for p in prompts]
        for special, idx in texts.items():   # one tokenizer call per kind: the fast tokenizer batches
            encoded = self.tokenizer([prompts[i].text for i in idx], add_special_tokens=special)["input_ids"]
            for i, ids in zip(idx, encoded):
                out[i] = list(ids)
        for i, ids in enumerate(out):
            if not ids:
                raise ValueError(f"prompts[{i}].text: tokenizes to no tokens")
            if len(ids) >= self.max_model_len:
                raise ValueError(f"prompts[{i}]: {len(ids)} tokens leave no room to generate within "
                                 f"max_model_len={self.max_model_len}")
        return out

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _check_stop_support(self, p: SamplingParams) -> None:
        if p.stop and self.tokenizer is None:
            raise ValueError("sampling.stop: stop strings need a tokenizer, and this replica has none")

    # ---- generation (runs in a worker thread under the lock)

    def _generate_jobs(self, jobs: list[_Job]) -> list[list[PromptResult]]:
        """Decodes the rows of several requests together (chunks of max_batch_size rows)."""
        rows: list[_Row] = []
        for job in jobs:
            p = job.batch.sampling
            for ids in job.prompt_ids:     # prompt-major: row = prompt * n + sample
                for j in range(p.n):
                    rows.append(_Row(prompt=ids, budget=min(p.max_tokens, self.max_model_len - len(ids)), sampling=p,
                                     generator=row_generator(p.seed, ids, j) if p.seed is not None else None))
        chunk = self.config.max_batch_size
        for start in range(0, len(rows), chunk):
            self._decode(rows[start:start + chunk])
        version = self.weight_version
        out, it = [], iter(rows)
        for job in jobs:
            results = []
            for prompt, ids in zip(job.batch.prompts, job.prompt_ids):
                samples = []
                for _ in range(job.batch.sampling.n):
                    row = next(it)
                    text = row.text if row.text is not None else self.decode(row.tokens)
                    samples.append(SampleResult(response_ids=row.tokens, logprobs=row.logprobs, text=text,
                                                finish_reason=row.finish_reason or "length", weight_version=version,
                                                top_logprobs=row.top))
                results.append(PromptResult(prompt_id=prompt.id, prompt_ids=ids, samples=samples))
            out.append(results)
        self.stats["requests"] += len(jobs)
        self.stats["decode_batches"] += 1
        self.stats["samples"] += len(rows)
        self.stats["generated_tokens"] += sum(len(r.tokens) for r in rows)
        return out

    @torch.inference_mode()
    def _decode(self, rows: list[_Row]) -> None:
        """Decodes rows together: left-padded prefill, then one token per step for the rows still running.

        Rows that finish are dropped from the batch (and the KV cache), so long tails do not pay for
        finished rows.
        """
        from transformers import DynamicCache

        if self._graph_decoder is not None and all(
                self._graph_decoder.can_decode(seeded=r.generator is not None, has_stops=bool(r.sampling.stop),
                                               top_logprobs=r.sampling.top_logprobs) for r in rows):
            return self._graph_decode(rows)
        dev = self.device
        # Prefill each distinct prompt once, then fan the KV cache out to its samples.
        uniq: dict[tuple[int, ...], int] = {}
        fan = [uniq.setdefault(tuple(r.prompt), len(uniq)) for r in rows]
        prompts = list(uniq)
        L = max(len(q) for q in prompts)
        ids = torch.full((len(prompts), L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), L), dtype=torch.long)
        for i, q in enumerate(prompts):
            ids[i, L - len(q):] = torch.tensor(q, dtype=torch.long)
            mask[i, L - len(q):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        ids, mask, pos = ids.to(dev), mask.to(dev), pos.to(dev)
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                         use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1, :].float()
        fan_t = torch.tensor(fan, dtype=torch.long, device=dev)
        if len(prompts) != len(rows) or fan != list(range(len(rows))):
            cache.batch_select_indices(fan_t)
            logits, mask, pos = logits[fan_t], mask[fan_t], pos[fan_t]
        next_pos = pos[:, -1:] + 1                                         # [B, 1]

        # Bookkeeping stays in tensors (one op per step, not one Python step per row); lists at the end.
        R, T = len(rows), max(r.budget for r in rows)
        out_tok = torch.zeros((R, T), dtype=torch.long, device=dev)
        out_lp = torch.zeros((R, T), dtype=torch.float32, device=dev)
        k_top = min(max(r.sampling.top_logprobs for r in rows), self.vocab_size)
        if k_top:
            out_top_i = torch.zeros((R, T, k_top), dtype=torch.long, device=dev)
            out_top_v = torch.zeros((R, T, k_top), dtype=torch.float32, device=dev)
        lengths = torch.zeros(R, dtype=torch.long, device=dev)
        stopped = torch.zeros(R, dtype=torch.bool, device=dev)             # eos or a stop string
        budget = torch.tensor([r.budget for r in rows], dtype=torch.long, device=dev)
        eos = torch.tensor(sorted(self.eos_ids) or [-1], dtype=torch.long, device=dev)
        temperature = torch.tensor([r.sampling.temperature for r in rows], dtype=torch.float32, device=dev)
        top_p = torch.tensor([r.sampling.top_p for r in rows], dtype=torch.float32, device=dev)
        gens = [r.generator for r in rows]
        with_stops = [a for a, r in enumerate(rows) if r.sampling.stop]
        active = torch.arange(R, device=dev)                               # row index of each batch row
        step = 0
        while True:
            logp = F.log_softmax(logits, dim=-1)                              # raw distribution, fp32
            act = active.tolist()
            tok = sample_tokens(logits, temperature=temperature[active], top_p=top_p[active],
                                generators=[gens[a] for a in act])
            out_tok[active, step] = tok
            out_lp[active, step] = logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
            if k_top:
                top_v, top_i = logp.topk(k_top, dim=-1)
                out_top_i[active, step], out_top_v[active, step] = top_i, top_v
            hit = torch.isin(tok, eos)
            if with_stops:
                for b in (~hit).nonzero().flatten().tolist():
                    row = rows[act[b]]
                    stops = row.sampling.stop
                    if stops and self._hit_stop(row, out_tok[act[b], :step + 1].tolist(), stops):
                        hit[b] = True
            done = hit | (step + 1 >= budget[active])
            stopped[active[hit]] = True
            lengths[active[done]] = step + 1
            if bool(done.all()):
                break
            if bool(done.any()):
                keep = (~done).nonzero().flatten()
                cache.batch_select_indices(keep)
                tok, mask, next_pos, active = tok[keep], mask[keep], next_pos[keep], active[keep]
            mask = torch.cat([mask, mask.new_ones((mask.size(0), 1))], dim=1)
            out = self.model(input_ids=tok.unsqueeze(-1), attention_mask=mask, position_ids=next_pos,
                             past_key_values=cache, use_cache=True)
            logits = out.logits[:, -1, :].float()
            next_pos = next_pos + 1
            step += 1

        tok_l, lp_l, len_l, stop_l = out_tok.tolist(), out_lp.tolist(), lengths.tolist(), stopped.tolist()
        if k_top:
            ti_l, tv_l = out_top_i.tolist(), out_top_v.tolist()
        for a, row in enumerate(rows):
            L = len_l[a]
            row.tokens, row.logprobs = tok_l[a][:L], lp_l[a][:L]
            row.finish_reason = "stop" if stop_l[a] else "length"
            k = row.sampling.top_logprobs
            if k:
                row.top = [list(zip(ti_l[a][t][:k], tv_l[a][t][:k])) for t in range(L)]

    def _graph_decode(self, rows: list[_Row]) -> None:
        """The same decode as _decode, each step one CUDA graph replay (rows stay in the batch until all end)."""
        tokens, logprobs, stopped = self._graph_decoder.decode(
            [r.prompt for r in rows], [r.budget for r in rows], [r.sampling.temperature for r in rows],
            [r.sampling.top_p for r in rows])
        for row, t, lp, s in zip(rows, tokens, logprobs, stopped):
            row.tokens, row.logprobs, row.finish_reason = t, lp, "stop" if s else "length"

    def _hit_stop(self, row: _Row, tokens: list[int], stops: Sequence[str]) -> bool:
        """True when the decoded response contains a stop string; the text is cut before it (as in vLLM)."""
        text = self.decode(tokens)
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        if cut < 0:
            return False
        row.text = text[:cut]
        return True


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


@torch.no_grad()
def swap_in(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], *, adopt: bool = False) -> None:
    """The weight swap (call with the engine lock held): copies checked tensors into the parameters, or with
    adopt makes them the parameters' data (CPU models: no copy; they are views of the received buffer)."""
    if adopt:
        params = named_weights(model)
        for name, t in tensors.items():
            params[name].data = t
        return
    apply_weights(model, tensors)
    device = next(iter(model.parameters())).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)     # the swap is done, and the staging buffer free, before the version moves


def _deliver(jobs: list[_Job], work: asyncio.Future) -> None:
    """Hands each coalesced request its results, or the batch's error."""
    error = work.exception()
    for i, j in enumerate(jobs):
        if j.future.done():
            continue
        if error is not None:
            j.future.set_exception(error)
        else:
            j.future.set_result(work.result()[i])


def _try_tokenizer(path: str):
    # AutoTokenizer would build an empty tokenizer from config.json alone, so look for its files first.
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        log.warning("no tokenizer files in %s; only prompt_ids are accepted", path)
        return None
    try:
        return load_tokenizer(path)
    except Exception as e:  # noqa: BLE001 - a model folder without a tokenizer serves prompt_ids only
        log.warning("no tokenizer in %s (%s: %s); only prompt_ids are accepted", path, type(e).__name__, e)
        return None


def _first_id(x) -> int:
    return int(x[0]) if isinstance(x, (list, tuple)) else int(x)


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for src in (model.config.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                getattr(tokenizer, "eos_token_id", None)):
        if src is None:
            continue
        ids.update(int(x) for x in (src if isinstance(src, (list, tuple)) else [src]))
    return ids


ENGINES = {"torch": TorchEngine}


def build_engine(settings: RolloutSettings) -> RolloutEngine:
    """The engine `rollout.engine` names (the vllm and openai engines import their packages lazily)."""
    name = settings.rollout.engine
    if name == "openai":
        from services.rollout.openai_engine import OpenAIEngine
        return OpenAIEngine(settings)
    if name == "vllm":
        try:
            from services.rollout.vllm_engine import VLLMEngine  # type: ignore[import-not-found]
        except ImportError as e:
            raise ValueError(f"rollout.engine: 'vllm' is not available here ({e}); use 'torch' or 'openai'") from None
        return VLLMEngine(settings)
    return ENGINES[name](settings)
