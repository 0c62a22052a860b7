"""The torch engine's speed settings: its `auto` switches, resolved once at start-up, and its warm-up."""

from __future__ import annotations

import logging
import time

import torch

from services.common.auto import Resolved
from services.common.tensors.compile import keep_compile_cache
from services.rollout.config import AUTO_MAX_BATCH_SIZE
from services.rollout.types import bucket_len

log = logging.getLogger("meshrl.rollout")


def resolve_speed(r, device: str, model) -> Resolved:
    """The torch engine's `auto` switches: on a CUDA device with a model the graph decoders support and Triton, the
    paged KV cache with its CUDA-graph step (else the unpaged CUDA-graph decoder), their compile, 512 rows per batch
    there (64 elsewhere). An explicit true or paged that cannot work is refused."""
    from services.rollout.engine_torch.graph_step import unsupported_reason

    out = Resolved("rollout", log)
    model_reason = unsupported_reason(model)
    reason = model_reason if str(device).startswith("cuda") else f"model.device is {device!r}, not CUDA"
    if r.cuda_graphs is True and reason is not None:
        raise ValueError(f"rollout.cuda_graphs: true cannot work here ({reason}); set it to auto or false")
    paged, paged_graphs = _resolve_paged(out, r, device, model, reason, model_reason)
    any_graphs = _resolve_graphs(out, r, reason, paged) or (paged and paged_graphs)
    # Either graph path's step runs the compiled layer (graph_step.py, paged/forward.py DecodeStep).
    triton_ok = _triton_available() if any_graphs else False
    if any_graphs and r.cuda_graph_compile is True and not triton_ok:
        raise ValueError("rollout.cuda_graph_compile: true needs Triton (inductor's GPU backend), which does not "
                         "import here; set it to auto or false")
    if out.pick("rollout.cuda_graph_compile", r.cuda_graph_compile, any_graphs and triton_ok,
                "Triton available" if triton_ok else ("no Triton" if any_graphs else "no CUDA graphs")):
        keep_compile_cache()
    out.pick("rollout.max_batch_size", r.max_batch_size, AUTO_MAX_BATCH_SIZE[any_graphs],
             "CUDA-graph decode: the KV cache follows each batch's rows" if any_graphs else "eager decode loop")
    return out


def _resolve_paged(out: Resolved, r, device: str, model, reason: str | None,
                   model_reason: str | None) -> tuple[bool, bool]:
    """rollout.kv_cache and rollout.kv_cache_cuda_graphs: auto takes the paged cache where its CUDA-graph step runs
    (CUDA, a model the graph decoders support, Triton, power-of-two kv_block_size and head_dim), where it decodes
    as fast as the unpaged graph decoder or faster on every case measured (bench/results/paged_kv_gpu.json) and
    keeps what it computed across calls; elsewhere today's cache (on CPU the suites and benches pin it). reason: why
    the graph decoders cannot run here (None: they can); model_reason: why not for this model on any device."""
    from services.rollout.engine_torch.paged import attention

    if r.kv_cache == "paged" and model_reason is not None:
        raise ValueError(f"rollout.kv_cache: paged cannot work here ({model_reason}); set it to auto or none")
    kernel = (f"model.device is {device!r}, not CUDA" if not str(device).startswith("cuda")
              else attention.graphs_reason(next(model.parameters()).device, r.kv_block_size,
                                           model.model.layers[0].self_attn.head_dim))
    if r.cuda_graphs is True:
        auto_why = "cuda_graphs: true asks for the unpaged CUDA-graph decoder"
    elif reason or kernel:
        auto_why = f"{reason or kernel}: the paged cache's CUDA-graph step cannot run"
    else:
        auto_why = None
    paged = out.pick("rollout.kv_cache", r.kv_cache, "paged" if auto_why is None else "none",
                     auto_why or "CUDA, Triton: the paged cache's CUDA-graph step") == "paged"
    kernel = "kv_cache is none" if not paged else kernel
    if r.kv_cache_cuda_graphs is True and paged and kernel is not None:
        raise ValueError(f"rollout.kv_cache_cuda_graphs: true cannot work here ({kernel}); set it to auto or false")
    paged_graphs = out.pick("rollout.kv_cache_cuda_graphs", r.kv_cache_cuda_graphs, kernel is None,
                            "paged cache on CUDA with the Triton paged kernel" if kernel is None else kernel)
    return paged, paged_graphs


def _resolve_graphs(out: Resolved, r, reason: str | None, paged: bool) -> bool:
    """rollout.cuda_graphs (the unpaged CUDA-graph decoder): auto on where it runs, unless the paged cache decodes
    every row (then it would only take a warm-up and memory)."""
    if paged and reason is None:
        return out.pick("rollout.cuda_graphs", r.cuda_graphs, False, "kv_cache is paged: its own graphs decode")
    return out.pick("rollout.cuda_graphs", r.cuda_graphs, reason is None,
                    "CUDA device, torch engine" if reason is None else reason)


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
        return True
    except ImportError:
        return False


def _warm_up_batches(max_tokens: int, max_model_len: int, pad_id: int, vocab_size: int, max_batch_size: int):
    """The warm-up's two small batches at rollout.max_tokens, as (rows, prompt, budget, temperature): sampled, then
    greedy as held-out evaluation decodes, the second of another size and length bucket (a longer prompt crosses
    into the next 256-token bucket), so torch.compile builds its dynamic-size graph during the warm-up, not at a
    run's first batch."""
    budget = max(1, min(max_tokens, max_model_len // 2 - 1))
    token = pad_id + 1 if pad_id + 1 < vocab_size else 0
    longer = bucket_len(1 + budget) + 1 - budget
    if longer + budget > max_model_len:
        longer = 1
    return [(min(8, max_batch_size), [token], budget, 1.0), (min(16, max_batch_size), [token] * longer, budget, 0.0)]


def warm_up_decoder(decoder, max_tokens: int, max_model_len: int, pad_id: int, vocab_size: int,
                    max_batch_size: int) -> float:
    """Compiles the graph decoder's step and captures its graphs before the replica serves; returns the seconds.

    _warm_up_batches' two batches: a run's first batch of any size then only captures a graph (well under a second)
    instead of compiling inside the run's first step. The warm-up's KV buckets are dropped afterwards; the compiled
    code, Triton kernels and cuBLAS handles stay."""
    t0 = time.perf_counter()
    for rows, prompt, budget, temperature in _warm_up_batches(max_tokens, max_model_len, pad_id, vocab_size,
                                                              max_batch_size):
        decoder.decode([prompt] * rows, [budget] * rows, [temperature] * rows, [1.0] * rows, seeds=[None] * rows)
    decoder.reset()
    torch.cuda.synchronize(decoder.device)
    seconds = time.perf_counter() - t0
    log.info("rollout: warm-up (compile + graph capture) took %.1f s", seconds)
    return seconds


def warm_up_paged(paged, max_tokens: int, max_model_len: int, pad_id: int, vocab_size: int, max_batch_size: int,
                  version: int) -> float:
    """The paged cache's warm_up_decoder: _warm_up_batches through its decode compile its step and capture graphs
    before the replica serves. What they cached goes (an epoch bump, as a weight swap's) and the counters start from
    zero, so a run's metrics count its own calls only."""
    from services.rollout.engine_torch.decode import Row
    from services.rollout.types import SamplingParams

    t0 = time.perf_counter()
    for rows, prompt, budget, temperature in _warm_up_batches(max_tokens, max_model_len, pad_id, vocab_size,
                                                              max_batch_size):
        sampling = SamplingParams(temperature=temperature, max_tokens=budget)
        paged.decode([Row(prompt=list(prompt), budget=budget, sampling=sampling) for _ in range(rows)], version,
                     eos_ids=[])
    paged.set_version(version)
    for counters in (paged.stats, paged.pool.stats):
        for key in counters:
            counters[key] = 0
    if paged.device.type == "cuda":
        torch.cuda.synchronize(paged.device)
    seconds = time.perf_counter() - t0
    log.info("rollout: paged KV warm-up (compile + graph capture) took %.1f s", seconds)
    return seconds
