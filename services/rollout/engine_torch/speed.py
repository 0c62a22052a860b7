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
    """The torch engine's `auto` switches: CUDA graphs (and their compile) on a CUDA device with a model the graph
    decoder supports, 512 rows per batch there (64 elsewhere). An explicit true that cannot work is refused."""
    from services.rollout.engine_torch.graph_step import unsupported_reason
    from services.rollout.engine_torch.paged import attention

    out = Resolved("rollout", log)
    cuda = str(device).startswith("cuda")
    reason = unsupported_reason(model) if cuda else f"model.device is {device!r}, not CUDA"
    if r.cuda_graphs is True and reason is not None:
        raise ValueError(f"rollout.cuda_graphs: true cannot work here ({reason}); set it to auto or false")
    graphs = out.pick("rollout.cuda_graphs", r.cuda_graphs, reason is None,
                      "CUDA device, torch engine" if reason is None else reason)
    paged_reason = unsupported_reason(model)
    if r.kv_cache == "paged" and paged_reason is not None:
        raise ValueError(f"rollout.kv_cache: paged cannot work here ({paged_reason}); set it to auto or none")
    # auto stays on today's cache everywhere: on an H100 the paged decode step is still slower than the graph decoder's
    # (bench/results/paged_kv_gpu.json); on CPU it is tested, but the CPU suites and benches pin today's loop
    # (docs/rollout.md lists what a CPU switch to paged changed).
    paged = out.pick("rollout.kv_cache", r.kv_cache, "none", "paged KV is opt-in: its decode step is slower than "
                     "the CUDA-graph decoder's on a GPU (docs/rollout.md)") == "paged"
    kernel = ("kv_cache is none" if not paged else f"model.device is {device!r}, not CUDA" if not cuda
              else attention.graphs_reason(next(model.parameters()).device, r.kv_block_size,
                                           model.model.layers[0].self_attn.head_dim))
    if r.kv_cache_cuda_graphs is True and paged and kernel is not None:
        raise ValueError(f"rollout.kv_cache_cuda_graphs: true cannot work here ({kernel}); set it to auto or false")
    paged_graphs = out.pick("rollout.kv_cache_cuda_graphs", r.kv_cache_cuda_graphs, kernel is None,
                            "paged cache on CUDA with the Triton paged kernel" if kernel is None else kernel)
    # Either graph path's step runs the compiled layer (graph_step.py, paged/forward.py DecodeStep).
    any_graphs = graphs or (paged and paged_graphs)
    triton_ok = _triton_available() if any_graphs else False
    if any_graphs and r.cuda_graph_compile is True and not triton_ok:
        raise ValueError("rollout.cuda_graph_compile: true needs Triton (inductor's GPU backend), which does not "
                         "import here; set it to auto or false")
    if out.pick("rollout.cuda_graph_compile", r.cuda_graph_compile, any_graphs and triton_ok,
                "Triton available" if triton_ok else ("no Triton" if any_graphs else "no CUDA graphs")):
        keep_compile_cache()
    out.pick("rollout.max_batch_size", r.max_batch_size, AUTO_MAX_BATCH_SIZE[graphs],
             "CUDA-graph decode: the KV cache follows each batch's rows" if graphs else "eager decode loop")
    return out


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
        return True
    except ImportError:
        return False


def warm_up_decoder(decoder, max_tokens: int, max_model_len: int, pad_id: int, vocab_size: int,
                    max_batch_size: int) -> float:
    """Compiles the graph decoder's step and captures its graphs before the replica serves; returns the seconds.

    Two small batches at rollout.max_tokens (sampled, then greedy as held-out evaluation decodes): the second
    batch's other size and length bucket make torch.compile build its dynamic-size graph now, so a run's first
    batch of any size only captures a graph (well under a second) instead of compiling inside the run's first
    step. The warm-up's KV buckets are dropped afterwards; the compiled code, Triton kernels and cuBLAS handles
    stay."""
    t0 = time.perf_counter()
    budget = max(1, min(max_tokens, max_model_len // 2 - 1))
    token = pad_id + 1 if pad_id + 1 < vocab_size else 0
    # The second batch differs from the first in rows and in KV length bucket (a longer prompt crosses into the
    # next 256-token bucket), so both dimensions are compiled dynamic here, not at a run's first batch.
    longer = bucket_len(1 + budget) + 1 - budget
    if longer + budget > max_model_len:
        longer = 1
    for rows, prompt_len, temperature in ((min(8, max_batch_size), 1, 1.0),
                                          (min(16, max_batch_size), longer, 0.0)):
        prompt = [token] * prompt_len
        decoder.decode([prompt] * rows, [budget] * rows, [temperature] * rows, [1.0] * rows, seeds=[None] * rows)
    decoder.reset()
    torch.cuda.synchronize(decoder.device)
    seconds = time.perf_counter() - t0
    log.info("rollout: warm-up (compile + graph capture) took %.1f s", seconds)
    return seconds
