"""One run's connections, data and mutable state (RunContext), and the interface of a training family
(Algorithm) that the run carries. Opening a run lives in coordinator/training/algorithms.py, beside the registry."""

from __future__ import annotations

import asyncio
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

import grpc

from meshrl.v1 import trainer_pb2
from coordinator.recipe.config import RunConfig, TrainerLosses
from coordinator.recipe.data import Problem, PromptStream
from coordinator.training import advantages as adv_fns
from services.common.errors import FailedPrecondition, Unavailable
from services.common.rpc.pools import ReplicaPool
from services.common.rpc.tracing import phase_span
from services.rollout.types import SamplingParams


class TrainerUnavailable(Exception):
    """The trainer cannot be reached (it died or is restarting): the run pauses instead of failing."""

    advice = "restart the trainer"     # what the paused run's message tells the user to do before ResumeRun

    def resumes_from(self, step: int, checkpoint_step: int) -> str:
        """Where ResumeRun picks up: a restarted trainer that lost the weights goes back to the last checkpoint."""
        return f"step {step} (from the last checkpoint's step {checkpoint_step} if the trainer lost its weights)"


class CheckpointFailed(TrainerUnavailable, FailedPrecondition):
    """The trainer refused a checkpoint save or load (damaged, unwritable, disk full): the run pauses, naming the
    path and the cause, instead of failing; the user fixes the checkpoint's folder and resumes."""

    advice = "fix that checkpoint folder (free space, permissions, or restore an intact copy)"

    def resumes_from(self, step: int, checkpoint_step: int) -> str:
        return f"step {step}"               # the trainer kept its weights


# Checkpoint RPCs whose refusal pauses the run (CheckpointFailed), with the word for the message.
CHECKPOINT_CALLS = {"SaveCheckpoint": "saving", "LoadCheckpoint": "loading"}


# Trainer calls that name no adapter and touch none: asked as they are for a run of a named adapter too.
ADAPTERLESS = {"GetInfo", "CreateAdapter", "DeleteAdapter"}
# Trainer calls whose request has an `adapter` field that they do not read (it means another call's): refused.
IGNORES_ADAPTER = {"ExportHF"}


class GuardedTrainer:
    """The trainer stub, with UNAVAILABLE raised as TrainerUnavailable.

    So the run manager can tell a lost trainer (pause, resume from a checkpoint) from a lost replica
    (the pools retry elsewhere) or a bad request (the run fails).
    """

    def __init__(self, stub, address: str):
        self._stub = stub
        self._address = address
        # A concurrent LoRA run's named adapter on the trainer (coordinator/runapi/sharing.py): stamped on every
        # request that has an `adapter` field; "" = the run's weights, as ever.
        self.adapter = ""

    def __getattr__(self, name: str):
        method = getattr(self._stub, name)

        async def call(*args, **kwargs):
            if self.adapter and args and name not in ADAPTERLESS:
                if "adapter" not in args[0].DESCRIPTOR.fields_by_name or name in IGNORES_ADAPTER:
                    raise FailedPrecondition(f"adapter: run trains named adapter {self.adapter!r} beside other "
                                             f"runs; the trainer's {name} has no adapter (a run beside others "
                                             f"trains its LoRA actor alone: no critic, no DPO)")
                args[0].adapter = self.adapter
            try:
                return await method(*args, **kwargs)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    raise TrainerUnavailable(f"trainer {self._address} unavailable during {name}: "
                                             f"{e.details()}") from None
                if name in CHECKPOINT_CALLS and e.code() != grpc.StatusCode.INTERNAL:
                    raise CheckpointFailed(f"{CHECKPOINT_CALLS[name]} checkpoint {args[0].path!r} failed: "
                                           f"{e.details()}") from None
                raise

        return call


class TrainerAsReference(ReplicaPool):
    """The reference pool of a run whose trainer answers as the reference (actor.lora): its one replica is the
    trainer, so a lost replica is the lost trainer and the run pauses (TrainerUnavailable), as after any trainer
    call, instead of failing with `reference pool: no healthy replica`."""

    async def call(self, fn, *, prefer=None):
        try:
            return await super().call(fn, prefer=prefer)
        except Unavailable as e:
            raise TrainerUnavailable(f"trainer {', '.join(self.servers)} unavailable during reference log-probs "
                                     f"(under actor.lora it answers as the reference): {e}") from None


class PhaseTimer:
    """Wall seconds per phase; phases that run concurrently are timed separately."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            with phase_span(name):     # a child span of the step's trace (docs/observability.md)
                yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    async def run(self, name: str, coro):
        with self(name):
            return await coro


def no_summary(history: list[dict], final_evals: dict) -> dict:
    return {}


def rl_update_metrics(applied: dict) -> dict[str, float]:
    """A step's metrics from the trainer's record of it (GetInfo details `run_step_metrics`): what the coordinator
    sent with the update, then the actor's and the critic's update metrics under the names the step gives them."""
    return {**applied.get("coordinator", {}), **{f"actor/{k}": v for k, v in applied.get("update", {}).items()},
            **{f"critic/{k}": v for k, v in applied.get("critic", {}).items()}}


@dataclass(frozen=True)
class Algorithm:
    """A training family as a run drives it: RL (GRPO, PPO, RLOO, REINFORCE++: coordinator/training/loop.py) or DPO
    (coordinator/training/dpo.py). ALGORITHMS in coordinator/training/algorithms.py holds one per `algorithm.kind`."""

    # (config, tokenizer, data position) -> (the stream the steps take from, the family's own state or None).
    load: Callable[[RunConfig, Any, int], tuple[PromptStream, Any]]
    # One step; its metrics are recorded and the step committed by the run manager.
    step: Callable[[RunContext], Awaitable[dict[str, float]]]
    # Held-out metrics: `heldout_accuracy` always, plus the family's own.
    evaluate: Callable[[RunContext], Awaitable[dict[str, float]]]
    # (config, own state) -> why the run needs a reference pool, "" when it can do without one.
    reference_needed: Callable[[RunConfig, Any], str]
    # Rollout and reward pools: required (they make the samples), or used only when configured.
    needs_rollout: bool = True
    # (metrics history, last evaluation) -> extra keys of summary.json.
    summary: Callable[[list[dict], dict], dict] = no_summary
    # The trainer's record of a step the coordinator never committed -> that step's metrics, as far as they were
    # kept (coordinator/runapi/recovery.py).
    recovered_metrics: Callable[[dict], dict[str, float]] = rl_update_metrics


@dataclass
class RunContext:
    """Connections, data and mutable state of one run."""

    run_id: str
    cfg: RunConfig
    algorithm: Algorithm
    run_dir: Path
    rollout: ReplicaPool | None
    reward: ReplicaPool | None
    reference: ReplicaPool | None
    trainer_channel: object
    trainer: object
    # The training stream (prompts, or preference pairs for DPO); its position is run state.
    data: PromptStream
    heldout: list[Problem]
    losses: TrainerLosses
    # The algorithm's own state (DPO: held-out pairs and the reference cache); None for RL.
    state: Any = None
    step: int = 0
    weight_version: int = 0
    # Where the run's weights came from as it started, in words (the trainer's ConfigureRun answer; "" at a resume).
    started_from: str = ""
    kl_coef: float = 0.0
    kl_controller: adv_fns.AdaptiveKLController | None = None
    # async_mode: the batches in flight (coordinator/training/async_rollouts.py InFlight); cancelled at close.
    prefetched: Any = None
    # async_mode: the run's ledger of prompt groups in its store (coordinator/training/ledger.py); None: not kept.
    ledger: Any = None
    # The last step's samples, for tests and debugging.
    last_samples: list = field(default_factory=list)
    # What the run has said once (a warning it gives once per run).
    said: set = field(default_factory=set)
    # Its named adapter on the trainer when it runs beside other LoRA runs ("" = the trainer's run adapter).
    adapter: str = ""
    # Held while generate brings joined or restarted replicas up to date (phases.bring_new_replicas_up_to_date):
    # the batches an async run launches together push the weights once, not once each.
    catch_up: asyncio.Lock = field(default_factory=asyncio.Lock)
    closed: bool = False

    @property
    def sampling(self) -> SamplingParams:
        return self.sampling_at(self.step + 1)

    def sampling_at(self, step: int, gen_batch: int = 0) -> SamplingParams:
        """The training sampling of run step `step` (1-based; async runs generate steps ahead); `gen_batch`: the
        step's generation batch under algorithm.filter_groups (0 = its first)."""
        r = self.cfg.rollout
        # With rollout.seed set, each step has its own seed, so a run (and a step retried on another
        # replica) is reproducible; None leaves the replicas unseeded.
        seed = None
        if r.seed is not None:
            seed = ((r.seed * 1_000_003 + step + gen_batch * 1_000_000_007) & (2**63 - 1)) or 1
        return r.sampling(seed=seed)

    async def close(self) -> None:
        """Frees what the run holds (its in-flight batches, named adapter, pools, trainer channel); once."""
        if self.closed:
            return
        self.closed = True
        if self.prefetched:
            self.prefetched.cancel()
        if self.adapter:        # its weights and optimizer state leave the trainer with the run
            await drop_adapter(self.trainer, self.adapter)
        for pool in (self.rollout, self.reward, self.reference):
            if pool is not None:
                await pool.close()
        await self.trainer_channel.close()


async def drop_adapter(trainer, name: str) -> None:
    """Deletes a run's named adapter; a trainer that is gone or no longer holds it has nothing to free."""
    try:
        await trainer.DeleteAdapter(trainer_pb2.AdapterRequest(name=name))
    except (TrainerUnavailable, grpc.aio.AioRpcError):
        pass
