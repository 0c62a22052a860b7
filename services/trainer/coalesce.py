"""Concurrent log-prob calls of equal settings share one command: the calls that queue while one of them waits for
the trainer's command lock ride in its command, over their rows concatenated, and each caller gets its own rows back.

The rollout engine's coalesced Generate (services/rollout/engine_torch/engine.py, `_Job` and `_deliver`) in threads:
the trainer's commands run one at a time (services/trainer/commands.py), so with several runs on one trainer their
reference calls (the base model, adapters off, the very same forward) would queue one after another. Calls merge only
where the command's arguments other than the rows are equal (same temperature, same model); the command micro-batches
the rows itself. Each call is checked before it queues, so a bad one fails alone; a failure of the merged command
reaches every call in it. A caller that gives up (a gRPC deadline) leaves its thread to finish: the others are
answered either way.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

from services.trainer.commands import Commands


@dataclass(eq=False)
class _Call:
    """One queued log-prob call: its checked rows, the settings a command's partners must share, its outcome."""

    settings: tuple
    prompts: list[list[int]]
    responses: list[list[int]]
    taken: bool = False                     # in a command (running or waiting for the lock)
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None

    def outcome(self) -> list[list[float]]:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result


class Coalescer:
    """Runs command `name(prompts, responses, temperature, *extra)` for concurrent calls, merged up to `max_rows` rows
    a command (the trainer's request-size limit, actor.max_batch_size)."""

    def __init__(self, commands: Commands, name: str, *extra, max_rows: int):
        self.commands = commands
        self.name = name
        self.extra = extra
        self.max_rows = max_rows
        self._cond = threading.Condition()
        self._pending: list[_Call] = []
        self._leading = False               # a call waits for the command lock to run what is pending
        # calls run, commands run for them, and calls that shared their command with another call
        self.stats = {"calls": 0, "commands": 0, "merged_calls": 0}

    def logprobs(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                 temperature: float) -> list[list[float]]:
        """The command's answer for these rows (checked by the caller), run alone or merged with concurrent calls."""
        call = _Call((float(temperature),), [list(p) for p in prompts], [list(r) for r in responses])
        with self._cond:
            self._pending.append(call)
            # Another call leads a command: wait until it takes this one, or leaves it behind (other settings, or
            # past max_rows) and this one may lead the next.
            while self._leading and not call.taken:
                self._cond.wait()
            lead = not call.taken
            self._leading = self._leading or lead
        if lead:
            self._lead(call)
        return call.outcome()

    def _lead(self, call: _Call) -> None:
        """Runs a command for `call` and the pending calls that join it once the lock is held; answers them all."""
        batch: list[_Call] = []

        def build() -> tuple:
            batch.extend(self._take(call))
            return ([p for c in batch for p in c.prompts], [r for c in batch for r in c.responses],
                    *call.settings, *self.extra)

        try:
            out = self.commands.run_built(self.name, build)
        except BaseException as e:          # noqa: BLE001 - handed to every call of the command
            if not batch:                   # the lock was never taken: this call alone
                batch.extend(self._take(call, alone=True))
            _deliver(batch, None, e)
        else:
            assert len(out) == sum(len(c.prompts) for c in batch), "a merged command answered other rows"
            _deliver(batch, out, None)

    def _take(self, call: _Call, *, alone: bool = False) -> list[_Call]:
        """`call` and the pending calls of its settings, in arrival order, within max_rows rows; the rest wait for
        the next command (one of them leads it)."""
        with self._cond:
            batch, rows = [call], len(call.prompts)
            for other in self._pending:
                if not alone and other is not call and other.settings == call.settings \
                        and rows + len(other.prompts) <= self.max_rows:
                    batch.append(other)
                    rows += len(other.prompts)
            for c in batch:
                c.taken = True
                self._pending.remove(c)
            self._leading = False
            self._cond.notify_all()
            self.stats["calls"] += len(batch)
            self.stats["commands"] += 1
            self.stats["merged_calls"] += len(batch) if len(batch) > 1 else 0
        return batch

    def queued(self) -> int:
        """Calls waiting for a command (not yet taken into one)."""
        with self._cond:
            return len(self._pending)

    def info(self, prefix: str) -> dict[str, int]:
        with self._cond:
            return {f"{prefix}_{k}": v for k, v in self.stats.items()}


def _deliver(batch: list[_Call], out: list[list[float]] | None, error: BaseException | None) -> None:
    """Hands each call of a command its own rows, in order, or the command's error."""
    start = 0
    for c in batch:
        if error is not None:
            c.error = error
        else:
            c.result = out[start:start + len(c.prompts)]
            start += len(c.prompts)
        c.done.set()
