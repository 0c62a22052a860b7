"""The `torch` rollout engine: a Hugging Face causal LM with its own batched decode loop.

Here the engine's side of a decode: requests that queue while one decodes are decoded together (one engine lock,
one torch job at a time), each row gets its sampling settings, and weight swaps land whole between decodes, or
(partial rollouts) between two decode steps of a running one. How one chunk of rows is decoded (left padding and a
KV cache, so every sampled token's log-prob is the raw-model log-prob the trainer will recompute) is decode.py;
with CUDA graphs and rollout.continuous_batching, requests that arrive mid-decode join it (continuous.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterable, Callable, Mapping

import torch

from services.common.tensors.modeling import batched_logprobs, load_causal_lm, set_threads, validate_sequences
from services.common.tensors.weight_transport import receive_host
from services.common.tensors.weights import Manifest, apply_weights, check_against, named_weights
from services.rollout.config import RolloutSettings
from services.rollout.engine_torch.continuous import Flight, answer_of
from services.rollout.engine_torch.decode import Row, decode_rows
from services.rollout.engine_torch.lora import TorchAdapters, adapter_rows, build_bank
from services.rollout.engine_torch.sampling import row_generator
from services.rollout.engine_torch.speed import resolve_speed, warm_up_decoder, warm_up_paged
from services.rollout.local_model import LocalModelEngine, find_eos_ids, model_len_limit, try_tokenizer
from services.rollout.types import GenerateBatch, PromptResult, SampleResult, check_weight_version

log = logging.getLogger("meshrl.rollout")


class _Swap:
    """A weight swap posted while a generation may be running: the decode thread runs it at its next step boundary
    (partial rollouts), or the update runs it once it holds the engine lock; exactly once either way."""

    def __init__(self, fn: Callable[[], None]):
        self.fn = fn
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self._mutex = threading.Lock()
        self._claimed = False

    def claim(self) -> bool:
        with self._mutex:
            claimed, self._claimed = self._claimed, True
            return not claimed

    def run(self) -> bool:
        """Runs the swap unless it already ran (or was given up); whether this call ran it."""
        if not self.claim():
            return False
        try:
            self.fn()
        except BaseException as e:       # handed to the update that posted it
            _settle(self.future, e)
        else:
            _settle(self.future, None)
        return True


@dataclass
class _Job:
    """One queued Generate request: its validated prompts and the future its caller awaits."""

    batch: GenerateBatch
    prompt_ids: list[list[int]]
    future: asyncio.Future | None


class TorchEngine(TorchAdapters, LocalModelEngine):
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
        self.tokenizer = tokenizer if tokenizer is not None else try_tokenizer(m.path)
        cfg = self.model.config
        self.vocab_size = int(cfg.vocab_size)
        self.pad_id = _first_id(cfg.pad_token_id) if cfg.pad_token_id is not None else 0
        self.eos_ids = find_eos_ids(self.model, self.tokenizer)
        self.max_model_len = model_len_limit(r.max_model_len, cfg)
        self.weight_version = 0
        # CPU models: the buffer the served weights are views of (after a grpc update), and the one before it.
        self._weights_buffer: torch.Tensor | None = None
        self._spare_buffer: torch.Tensor | None = None
        # One torch job at a time (generation, scoring, weight swap); a swap lands mid-generation only in the decode
        # thread, between two steps of a partial-rollout batch (_swap, _between_steps).
        self._locks: dict[asyncio.AbstractEventLoop, asyncio.Lock] = {}
        self._pending: list[_Job] = []            # a running decode's thread takes joiners from it too
        self._pending_mutex = threading.Lock()
        self._runs: set[asyncio.Task] = set()     # decodes in flight (each holds the lock until it ends)
        # Weight swaps posted by updates, which a partial-rollout decode runs between two of its steps.
        self._swaps: list[_Swap] = []
        self._swaps_mutex = threading.Lock()
        self.stats = {"requests": 0, "decode_batches": 0, "samples": 0, "generated_tokens": 0,
                      "swaps_mid_generation": 0, "joined_rows": 0}
        self.resolved = resolve_speed(r, self.device, self.model)
        self.max_batch_size = self.resolved.value("rollout.max_batch_size")
        # LoRA adapters over the frozen base (rollout.enable_lora), before the graph decoder reads the layers.
        self.adapters = build_bank(settings, self.model, self.resolved, self.max_batch_size)
        self.supports_adapters = self.adapters is not None
        self._graph_decoder = None
        if self.resolved.value("rollout.cuda_graphs"):
            from services.rollout.engine_torch.cuda_decode import GraphDecoder
            self._graph_decoder = GraphDecoder(self.model, pad_id=self.pad_id, eos_ids=sorted(self.eos_ids),
                                               max_batch_size=self.max_batch_size,
                                               compile=self.resolved.value("rollout.cuda_graph_compile"),
                                               fused_sampler=r.cuda_graph_fused_sampler,
                                               triton_attention=r.cuda_graph_triton_attention)
        self._paged = None
        if self.resolved.value("rollout.kv_cache") == "paged":
            from services.rollout.engine_torch.paged.decoder import PagedDecoder
            # The paged step's layers are the graph decoder's (one set of fused buffers), compiled as its are.
            self._paged = PagedDecoder(self.model, block_size=r.kv_block_size, budget_gib=r.kv_cache_gib,
                                       max_model_len=self.max_model_len, max_batch_size=self.max_batch_size,
                                       cuda_graphs=self.resolved.value("rollout.kv_cache_cuda_graphs"),
                                       fused_sampler=r.cuda_graph_fused_sampler,
                                       compile=self.resolved.value("rollout.cuda_graph_compile"),
                                       max_tokens=r.max_tokens)
        self.warmup_seconds = 0.0
        log.info("rollout torch engine: %s on %s (%s), max_model_len=%d, max_batch_size=%d, tokenizer: %s",
                 self.model_path, self.device, self.dtype, self.max_model_len, self.max_batch_size, self.tokenizer is not None)

    def warm_up(self) -> float:
        """Compiles the graph decoder's (or the paged cache's) step and captures graphs before the replica serves
        (seconds; 0 without CUDA graphs or with rollout.warmup false): speed.py."""
        if self._graph_decoder is not None and self.config.warmup:
            self.warmup_seconds = warm_up_decoder(self._graph_decoder, self.config.max_tokens, self.max_model_len,
                                                  self.pad_id, self.vocab_size, self.max_batch_size)
        if self._paged is not None and self._paged.graphs is not None and self.config.warmup:
            self.warmup_seconds += warm_up_paged(self._paged, self.config.max_tokens, self.max_model_len, self.pad_id,
                                                 self.vocab_size, self.max_batch_size, self.weight_version)
        return self.warmup_seconds

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
        return {"engine": "torch", "max_model_len": self.max_model_len, "max_batch_size": self.max_batch_size,
                "resolved": self.resolved.json(), "warmup_seconds": round(self.warmup_seconds, 3),
                "device": self.device, "dtype": self.dtype, "vocab_size": self.vocab_size,
                "tokenizer": self.tokenizer is not None, **self.stats,
                **(self._paged.metrics() if self._paged is not None else {}),
                **({"adapters": json.dumps(self.adapters.versions, sort_keys=True)} if self.adapters else {})}

    async def generate(self, batch: GenerateBatch) -> list[PromptResult]:
        prompt_ids = self.check_batch(batch)   # before queueing behind the lock
        self.slot_of(batch.sampling.adapter)
        job = _Job(batch, prompt_ids, asyncio.get_running_loop().create_future())
        with self._pending_mutex:
            self._pending.append(job)
        try:
            # A request served meanwhile (coalesced into a batch, or joined a running decode) needs no lock.
            if await self._lock_unless(job.future):
                if job.future.done():
                    self._lock.release()
                else:
                    # Requests that queued while the previous batch ran are decoded together with this one, each
                    # row with its own sampling settings. The decode holds the lock until it ends, and each
                    # request returns once answered (with continuous batching, before the decode ends).
                    with self._pending_mutex:
                        jobs, self._pending = [j for j in self._pending if not j.future.done()], []
                    run = asyncio.ensure_future(self._decode_locked(jobs))
                    self._runs.add(run)
                    run.add_done_callback(self._runs.discard)
                    return await answer_of(job.future, run)
        finally:
            with self._pending_mutex:
                if job in self._pending:
                    self._pending.remove(job)
        return await job.future

    async def _decode_locked(self, jobs: list[_Job]) -> None:
        """Decodes `jobs` with the engine lock held (taken by the caller), then releases it; errors go to the jobs."""
        try:
            await self._run_locked(self._generate_jobs, jobs, on_done=lambda work: _deliver(jobs, work))
        except (Exception, asyncio.CancelledError):      # handed to the jobs by _deliver
            pass
        finally:
            self._lock.release()

    async def _lock_unless(self, served: asyncio.Future) -> bool:
        """Takes the engine lock, unless `served` completes first; whether this holds the lock."""
        if not self._lock.locked():
            return await self._lock.acquire()        # free: taken at once, before other requests queue
        acquire = asyncio.ensure_future(self._lock.acquire())
        try:
            await asyncio.wait({served, acquire}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            await self._give_up(acquire)
            raise
        if acquire.done():
            return True
        await self._give_up(acquire)
        return False

    async def _give_up(self, acquire: asyncio.Future) -> None:
        """Cancels a lock acquisition; releases the lock when it was granted before the cancel."""
        acquire.cancel()
        try:
            await acquire
        except asyncio.CancelledError:
            return
        self._lock.release()

    def generate_sync(self, batch: GenerateBatch) -> list[PromptResult]:
        """generate() for scripts and benchmarks: same checks and decode, in this thread, without the lock."""
        return self._generate_jobs([_Job(batch, self.check_batch(batch), None)])[0]

    async def logprobs(self, prompts, responses, temperature: float = 1.0, *, adapter: str = ""):
        validate_sequences(prompts, responses, vocab_size=self.vocab_size, max_len=self.max_model_len)
        slots = [self.slot_of(adapter)] * len(prompts)      # every micro-batch reads a prefix of these
        async with self._lock:
            with adapter_rows(self.adapters, slots):
                out = await self._run_locked(batched_logprobs, self.model, prompts, responses, pad_id=self.pad_id,
                                             temperature=temperature, token_budget=self.config.logprobs_token_budget)
            return out, self.weight_version

    def end_episode(self, episode_id: str) -> None:
        if self._paged is not None:
            self._paged.end_episode(episode_id)

    async def apply_adapter(self, name: str, version: int, config: dict, tensors: dict[str, torch.Tensor]) -> None:
        """load_adapter where a weight swap lands: between decodes, or between two steps of a partial rollout."""
        await self._swap(_Swap(lambda: self.load_adapter(name, version, config, tensors)))

    async def remove_adapter(self, name: str) -> bool:
        # Under the lock, never at a partial rollout's step boundary: a running row of that adapter would go on
        # under the base's weights. Once the decodes using it end, no request can name it again.
        async with self._lock:
            return await self._run_locked(self.unload_adapter, name)

    async def update_weights(self, manifest: Manifest, buckets: AsyncIterable[tuple[bytes, int]]) -> dict:
        start = time.perf_counter()
        check_weight_version(manifest.version)
        # Every bucket lands CRC-checked in one preallocated buffer (off the event loop) before any weight moves: the
        # spare (the weights' buffer before the last swap) when it fits; taken, so a concurrent update gets its own.
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
        check_weight_version(version)
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
            if self._graph_decoder is not None:
                self._graph_decoder.refresh_weights()
            self.weight_version = version
            if self._paged is not None:
                self._paged.set_version(version)    # pinned episodes' KV is the old weights': let go now

        await self._swap(_Swap(swap_and_tag))

    async def _swap(self, swap: _Swap) -> None:
        """Runs `swap` at the next step boundary of a running partial-rollout decode, or under the lock: whichever
        comes first. Returns once it landed (not when the generation ends)."""
        with self._swaps_mutex:
            self._swaps.append(swap)
        landed = asyncio.wrap_future(swap.future)
        acquire = asyncio.ensure_future(self._lock.acquire())
        held = False
        try:
            await asyncio.wait({landed, acquire}, return_when=asyncio.FIRST_COMPLETED)
            if not landed.done():         # the lock came first: no decode runs, so it lands here
                held = True
                await self._run_locked(swap.run)
            await landed
        finally:
            swap.claim()                  # a cancelled update's swap does not land later
            with self._swaps_mutex:
                if swap in self._swaps:
                    self._swaps.remove(swap)
            if not held:
                acquire.cancel()
                try:
                    held = await acquire  # True when it got the lock before the cancel
                except asyncio.CancelledError:
                    held = False
            if held:
                self._lock.release()

    def _swap_point(self) -> int:
        """Runs the swaps posted since the last call (in this decode thread, between two steps); the version now."""
        with self._swaps_mutex:
            swaps, self._swaps = self._swaps, []
        for swap in swaps:
            self.stats["swaps_mid_generation"] += swap.run()
        return self.weight_version

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

    # ---- generation (runs in a worker thread under the lock)

    def _generate_jobs(self, jobs: list[_Job]) -> list[list[PromptResult]]:
        """Decodes the rows of several requests together (chunks of max_batch_size rows); each request is answered
        once its rows ended, and with continuous batching, requests pending meanwhile join the graph decode."""
        # Partial rollouts: updates land between steps when every request allows it (pause if one asks for it).
        modes = {job.batch.partial_rollout for job in jobs}
        partial = "off" if "off" in modes else "pause" if "pause" in modes else "continue"
        flight = Flight(partial, self._results_of)
        rows = [row for job in jobs for row in flight.add(job, self._rows_of(job))]
        chunk = self.max_batch_size
        try:
            for start in range(0, len(rows), chunk):
                version = self._swap_point() if partial != "off" else self.weight_version
                for row in rows[start:start + chunk]:
                    row.version = version
                decode_rows(self, rows[start:start + chunk], partial=partial, flight=flight)
                flight.ended(rows[start:start + chunk])
        except BaseException as e:
            flight.fail(e)
            raise
        self.stats["requests"] += len(flight.jobs)
        self.stats["decode_batches"] += 1
        self.stats["samples"] += len(flight.rows)
        self.stats["generated_tokens"] += sum(len(r.tokens) for r in flight.rows)
        return [flight.results[id(job)] for job in jobs]

    def _rows_of(self, job: _Job) -> list[Row]:
        p = job.batch.sampling
        slot = self.slot_of(p.adapter)
        return [Row(prompt=ids, budget=min(p.max_tokens, self.max_model_len - len(ids)), sampling=p,
                    generator=row_generator(p.seed, ids, j) if p.seed is not None else None, slot=slot,
                    episode=prompt.episode_id if p.n == 1 else "")       # prompt-major: row = prompt * n + sample
                for prompt, ids in zip(job.batch.prompts, job.prompt_ids) for j in range(p.n)]

    def _results_of(self, job: _Job, rows: list[Row]) -> list[PromptResult]:
        results, it = [], iter(rows)
        for prompt, ids in zip(job.batch.prompts, job.prompt_ids):
            samples = []
            for _ in range(job.batch.sampling.n):
                row = next(it)
                text = row.text if row.text is not None else self.decode(row.tokens)
                samples.append(SampleResult(response_ids=row.tokens, logprobs=row.logprobs, text=text,
                                            finish_reason=row.finish_reason or "length",
                                            weight_version=row.version, top_logprobs=row.top,
                                            weight_versions=row.weight_versions(),
                                            cached_prompt_tokens=row.cached))
            results.append(PromptResult(prompt_id=prompt.id, prompt_ids=ids, samples=samples))
        return results

    def _between_steps(self, rows: list[Row], first_token: int) -> bool:
        """Partial rollouts: lands the posted weight swaps; the rows' tokens from `first_token` on are the new
        version's. Whether the version moved."""
        before = self.weight_version
        after = self._swap_point()
        if after != before:
            for r in rows:
                r.swaps.append((first_token - r.start, after))
        return after != before


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


def _settle(future: concurrent.futures.Future, error: BaseException | None) -> None:
    """The swap's outcome to its update (which may have been cancelled meanwhile)."""
    try:
        future.set_exception(error) if error is not None else future.set_result(None)
    except concurrent.futures.InvalidStateError:
        pass


def _first_id(x) -> int:
    return int(x[0]) if isinstance(x, (list, tuple)) else int(x)
