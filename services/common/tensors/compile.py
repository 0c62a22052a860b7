"""The decoder blocks of a Hugging Face model, and regional torch.compile over them (trainer and reference)."""

from __future__ import annotations

import logging
import os
import random
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

log = logging.getLogger("meshrl.modeling")


def blocks_container(model: nn.Module) -> nn.Module:
    """The module holding the repeated decoder layers (a ModuleList, or a ModuleDict on a pipeline stage)."""
    for path in ("model.layers", "model.model.layers", "layers"):
        node = model
        try:
            for part in path.split("."):
                node = getattr(node, part)
        except AttributeError:
            continue
        return node
    raise ValueError(f"{type(model).__name__}: no decoder layers found (expected model.layers)")


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder layers of a HF causal LM, a value model, or a pipeline stage (a ModuleDict)."""
    node = blocks_container(model)
    return list(node.values()) if isinstance(node, nn.ModuleDict) else list(node)


def keep_compile_cache() -> str:
    """Points inductor's cache at ~/.cache/meshrl/inductor (XDG_CACHE_HOME honoured) unless
    TORCHINDUCTOR_CACHE_DIR is set: its default under /tmp is lost when a machine or container restarts, and with
    it every compiled graph, so each run of a new container would compile from scratch. Returns the folder."""
    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not folder:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        folder = os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(base / "meshrl" / "inductor")
    return folder


def apply_compile(model: nn.Module, enabled: bool, *, backend: str = "inductor") -> None:
    """torch.compile each decoder block in place (Module.compile: names and state dicts unchanged).

    Regional compilation: the blocks share one code object and their parameters are graph inputs, so
    one compiled graph (per shape regime and grad mode) serves every block; compiling the whole model
    would trace embeddings, head and loss too, for little gain and much longer start-up.
    """
    if not enabled:
        return
    keep_compile_cache()
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    import torch._inductor.config as inductor_config

    if hasattr(inductor_config.triton, "mix_order_reduction_non_strict_mode"):
        inductor_config.triton.mix_order_reduction_non_strict_mode = MIX_ORDER_NON_STRICT
    blocks = transformer_blocks(model)
    for block in blocks:
        block.compile(backend=backend)
    log.info("Applied torch.compile to %d blocks", len(blocks))


def remove_compile(model: nn.Module) -> int:
    """Undoes apply_compile: each decoder block runs eager again (Module.compile's compiled call dropped). Returns
    how many blocks were compiled."""
    blocks = [b for b in transformer_blocks(model) if getattr(b, "_compiled_call_impl", None) is not None]
    for block in blocks:
        block._compiled_call_impl = None
    return len(blocks)


# The shapes a warm-up runs: (prompt tokens, response tokens of each sequence). torch.compile builds a static graph
# at a path's first shape and a dynamic one at its second, which then serves every later size; and the packed path
# (sequences of different lengths in one row, services/common/tensors/packing.py) and the padded one (sequences of one
# length run as [B, L]) are different graphs. So each path is called at two sizes: a warm-up that missed one would
# leave its compiles to a run's first steps (seen on an H100: step 1 at 5x a steady step). A third, large size, for
# size-dependent choices inductor may still make (MIX_ORDER_NON_STRICT below removes the ones seen so far).
WARMUP_SHAPES = (
    [(24, 40 + 3 * i) for i in range(8)],           # different lengths: one packed row where packing is on
    [(40, 70 + 5 * i) for i in range(5)],
    [(64, 448 + 8 * i) for i in range(12)],         # about 6,700 tokens in one call
    [(24, 40)] * 8,                                 # one length: [B, L] rows
    [(40, 70)] * 5,
    [(64, 448)] * 12,                               # [12, 512]: 6,144 tokens
)
# One code object serves every block, in each grad mode, path and size regime: more graphs than dynamo's default
# limit of 8 (past it, a block runs eager for the rest of the process: seen as `hit config.recompile_limit (8)`).
RECOMPILE_LIMIT = 64
# Inductor's mix-order reduction (RMSNorm's backward reductions fused) checks a call's token count against three
# thresholds (tokens x hidden >= 5 MiB, tokens >= 2 x hidden, tokens >= 4096) and guards on each: four size regimes,
# each its own graph of forward and backward, and a run's micro-batches land in whichever the warm-up missed (an H100
# trainer log: padded [7, 540] recompiled in step 1, step 1 at 2.4x a steady step). Non-strict mode skips those
# checks ("helpful to avoid recompilations", its config says): one graph for every size.
MIX_ORDER_NON_STRICT = True


def warm_up_forward(run: Callable[[Sequence[Sequence[int]], Sequence[Sequence[int]]], object], *, vocab_size: int,
                    device, max_len: int | None = None) -> float:
    """Calls run(prompts, responses) on seeded random token rows of each of WARMUP_SHAPES (scaled down to fit
    `max_len` tokens a sequence); returns the seconds taken (the device synchronized). For services that compiled
    their blocks: compile before serving, not in step 1."""
    t0 = time.perf_counter()
    rng = random.Random(0)
    for shape in WARMUP_SHAPES:
        longest = max(p + r for p, r in shape)
        if max_len and longest > max_len:
            shape = [(max(1, p * max_len // longest), max(1, r * max_len // longest)) for p, r in shape]
        prompts = [[rng.randrange(1, vocab_size) for _ in range(p)] for p, _ in shape]
        responses = [[rng.randrange(1, vocab_size) for _ in range(r)] for _, r in shape]
        run(prompts, responses)
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0
