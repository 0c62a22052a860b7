"""Under `actor.lora` the trainer answers as the run's reference (coordinator/training/algorithms.py `_pools`): that
reference pool's one replica is the trainer. A trainer killed while it computes the step's reference log-probs must
pause the run (TrainerUnavailable: restart the trainer, then ResumeRun), as a trainer lost during any other call does,
not fail it with `Unavailable: reference pool: no healthy replica`, a run `meshrl resume` then refuses as FAILED
(found by `kill -9` of the trainer of `meshrl mesh examples/arith/grpo_lora.yaml` mid-run)."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from coordinator.recipe.config import RunConfig
from coordinator.training import remote
from coordinator.training.algorithms import ALGORITHMS, _pools
from coordinator.training.context import TrainerUnavailable
from services.common.config import load_config
from services.common.errors import Unavailable

ARITH = Path(__file__).resolve().parents[2] / "examples" / "arith"


def _reference_pool(recipe: str, dead: str, **sections):
    cfg = load_config(RunConfig, ARITH / recipe, data={"trainer": {"address": dead}, **sections})
    return _pools(cfg, ALGORITHMS["rl"], None, None)["reference"]


async def _reference_logprobs(pool) -> None:
    await pool.refresh()
    await pool.call(lambda stub: remote.logprobs(stub, []))


def test_a_lost_trainer_that_answers_as_the_reference_pauses_the_run_instead_of_failing_it():
    # A socket bound but not listening, held for the whole test: every connection to it is refused, as to a
    # killed trainer's port.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{held.getsockname()[1]}"
        pool = _reference_pool("grpo_lora.yaml", dead)
        assert [*pool.servers] == [dead]             # the trainer is the reference
        with pytest.raises(TrainerUnavailable, match=rf"trainer {dead} unavailable during reference log-probs"):
            asyncio.run(_reference_logprobs(pool))
        # A reference replica of its own (no actor.lora) is a replica like any other: its pool fails over, and with
        # none left the call fails as before (the run's trainer is fine).
        pool = _reference_pool("grpo.yaml", "127.0.0.1:1", reference={"servers": [dead]})
        with pytest.raises(Unavailable, match="reference pool: no healthy replica") as info:
            asyncio.run(_reference_logprobs(pool))
        assert not isinstance(info.value, TrainerUnavailable)
