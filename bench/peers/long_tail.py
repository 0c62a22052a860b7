"""The long-tailed workload of bench/e2e_grpo.py (`--lengths longtail`): each sample of the torch rollout engine
stops at its own drawn length, as real responses end at different lengths (a random model rarely samples eos).

Installed in the rollout process by bench/peers/mesh_timing.py when MESHRL_BENCH_LENGTHS is
"lognormal:MEDIAN:SIGMA:CAP:SEED": each decoded row's budget becomes min(its budget, a lognormal draw with that
median and sigma, capped at CAP, at least 1). Draws come from one seeded stream in row order (requests arrive
in the same order run after run). Benchmark-only: the engine itself has no such option.
"""

from __future__ import annotations

import math
import os
import random

ENV = "MESHRL_BENCH_LENGTHS"


def parse(text: str) -> tuple[float, float, int, int]:
    kind, median, sigma, cap, seed = text.split(":")
    if kind != "lognormal":
        raise ValueError(f"{ENV}: expected lognormal:MEDIAN:SIGMA:CAP:SEED, got {text!r}")
    return float(median), float(sigma), int(cap), int(seed)


def draws(median: float, sigma: float, cap: int, seed: int):
    rng = random.Random(seed)
    while True:
        yield max(1, min(cap, int(round(rng.lognormvariate(math.log(median), sigma)))))


def install() -> None:
    """Wraps TorchEngine._rows_of so each row stops at its drawn length (no-op unless ENV is set). Rows are made
    there for every path: a batch's own decode and rows that join a running one (continuous batching)."""
    if not os.environ.get(ENV):
        return
    from services.rollout.engine_torch import engine as torch_engine

    lengths = draws(*parse(os.environ[ENV]))
    orig = torch_engine.TorchEngine._rows_of

    def _rows_of(self, job):
        rows = orig(self, job)
        for r in rows:
            r.budget = min(r.budget, next(lengths))
        return rows

    torch_engine.TorchEngine._rows_of = _rows_of


def eos_at_drawn_lengths(eos_id: int, spec: str):
    """The same workload for a transformers `generate` (TRL's side of the comparison): a LogitsProcessor class
    whose instance, one per generate call, forces eos as the last of each row's drawn number of tokens."""
    import torch
    from transformers import LogitsProcessor

    lengths = draws(*parse(spec))

    class EosAtDrawnLength(LogitsProcessor):
        def __init__(self):
            self.start, self.limits = None, None

        def __call__(self, input_ids, scores):
            if self.start is None:
                self.start = input_ids.shape[1]
                self.limits = torch.tensor([next(lengths) for _ in range(input_ids.shape[0])], device=scores.device)
            force = input_ids.shape[1] - self.start + 1 >= self.limits      # this token is the row's last
            if bool(force.any()):
                scores = scores.clone()
                scores[force] = float("-inf")
                scores[force, eos_id] = 0.0
            return scores

    return EosAtDrawnLength


def patch_generate(model, eos_id: int, spec: str) -> None:
    """model.generate with EosAtDrawnLength added to its logits processors (a fresh one per call)."""
    from transformers import LogitsProcessorList

    processor = eos_at_drawn_lengths(eos_id, spec)
    orig = model.generate

    def generate(*args, **kwargs):
        procs = LogitsProcessorList(kwargs.pop("logits_processor", None) or [])
        procs.append(processor())
        return orig(*args, logits_processor=procs, **kwargs)

    model.generate = generate
