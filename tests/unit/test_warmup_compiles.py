"""Warm-up before serving: after the trainer's warm-up, its first real log-prob pass and update compile nothing.

torch.compile on CPU (inductor's C++ backend) stands in for the GPU on the padded path ([B, L] rows, with and
without gradients, static then dynamic sizes); on an H100 a warm-up that ran one path at one length left step 1
at 5x a steady step. (Packed rows on CPU attend sequence by sequence, a loop dynamo unrolls per sequence count, so
that path recompiles by design there; on CUDA it is one varlen kernel call, covered by tests/gpu.)"""

from __future__ import annotations

import random

import pytest
import torch

from services.common.config import load_config
from services.trainer.config import TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.testing import make_tiny_model
from services.trainer.types import ActorLoss, TrainSample

pytestmark = pytest.mark.slow          # inductor compiles C++ on the CPU: about a minute


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("warmup") / "model", num_hidden_layers=2)


def _frames() -> int:
    from torch._dynamo.utils import counters

    return counters["frames"]["ok"]


def test_after_warm_up_the_first_logprobs_and_update_compile_nothing(model_path):
    torch._dynamo.reset()
    eng = TrainerEngine(load_config(TrainerSettings, data={
        "model": {"path": model_path}, "actor": {"lr": 1e-3, "compile": True, "use_remove_padding": False}}))
    try:
        assert eng.warm_up() > 0
        warmed = _frames()
        assert warmed > 0                                   # the warm-up compiled the blocks
        rng = random.Random(1)
        vocab = eng.rank.vocab_size
        samples = []
        for _ in range(12):                                 # a GRPO batch: lengths that differ, as a run's do
            p, r = rng.randrange(3, 20), rng.randrange(5, 40)           # within the tiny model's 64
            samples.append(TrainSample(prompt_ids=[rng.randrange(3, vocab) for _ in range(p)],
                                       response_ids=[rng.randrange(3, vocab) for _ in range(r)],
                                       advantages=[rng.uniform(-1, 1)] * r, old_logprobs=[]))
        eng.compute_logprobs([s.prompt_ids for s in samples], [s.response_ids for s in samples])
        eng.train_actor_step(samples, ActorLoss(), None)        # one optimizer step: on-policy
        assert _frames() == warmed                          # nothing compiled in the "first step"
    finally:
        eng.close()
