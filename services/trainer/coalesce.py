"""Concurrent trainer calls that can share a command do: the calls that queue while one of them waits for the
trainer's command lock ride in its command, and each caller gets its own answer back.

The rollout engine's coalesced Generate (services/rollout/engine_torch/engine.py, `_Job` and `_deliver`) in threads:
the trainer's commands run one at a time (services/trainer/commands.py), so with several runs on one trainer their
calls would queue one after another. Two kinds merge:
- log-prob calls (`Coalescer`): the reference calls (the base model, adapters off, the very same forward) or the
  actor's, where the command's arguments other than the rows are equal (same temperature, same model), up to
  `max_rows` rows; the command micro-batches the rows itself;
- TrainActor calls of different LoRA adapters (`TrainMerger`): one pass over all their rows, each row under its own
  adapter (services/trainer/updates/merged.py), where their update loops have one shape (merged.merge_key); never
  two calls of one adapter (its updates apply in order).
Each call is checked before it queues, so a bad one fails alone; a failure of the merged command reaches every call
in it. A caller that gives up (a gRPC deadline) leaves its thread to finish: the others are answered either way.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from services.trainer.commands import Commands
from services.trainer.types import ActorLoss, TrainSample


@dataclass(eq=False)
class _Call:
    """One queued call: the key a command's partners must share (None: it runs alone), what it brings, its rows
    (against max_rows), the owner no partner may share (None: any), its outcome."""

    key: tuple | None
    payload: Any
    size: int
    owner: Any = None
    taken: bool = False                     # in a command (running or waiting for the lock)
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None

    def outcome(self) -> Any:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result


class _Merger:
    """Runs command `name` for concurrent calls, merged where their keys are equal, up to `max_rows` rows a command;
    a subclass says what the command's arguments are and which part of its answer is each call's."""

    def __init__(self, commands: Commands, name: str, *, max_rows: float):
        self.commands = commands
        self.name = name
        self.max_rows = max_rows
        self._cond = threading.Condition()
        self._pending: list[_Call] = []
        self._leading = False               # a call waits for the command lock to run what is pending
        # calls run, commands run for them, and calls that shared their command with another call
        self.stats = {"calls": 0, "commands": 0, "merged_calls": 0}

    def args(self, batch: list[_Call]) -> tuple:
        raise NotImplementedError

    def split(self, out: Any, batch: list[_Call]) -> list[Any]:
        """Each call's answer (an exception: that call's error), in order."""
        raise NotImplementedError

    def submit(self, call: _Call) -> Any:
        """The command's answer for `call` (checked by the caller), run alone or merged with concurrent calls."""
        with self._cond:
            self._pending.append(call)
            self._cond.notify_all()                 # a leader gathering its partners (TrainMerger) sees it
            # Another call leads a command: wait until it takes this one, or leaves it behind (another key, an
            # owner already in it, or past max_rows) and this one may lead the next.
            while self._leading and not call.taken:
                self._cond.wait()
            lead = not call.taken
            self._leading = self._leading or lead
        if lead:
            self._gather(call)
            self._lead(call)
        return call.outcome()

    def _gather(self, call: _Call) -> None:
        """The leader, before it asks for the lock: waits for partners it expects (TrainMerger); nothing here."""

    def _lead(self, call: _Call) -> None:
        """Runs a command for `call` and the pending calls that join it once the lock is held; answers them all."""
        batch: list[_Call] = []

        def build() -> tuple:
            batch.extend(self._take(call))
            return self.args(batch)

        try:
            out = self.commands.run_built(self.name, build)
        except BaseException as e:          # noqa: BLE001 - handed to every call of the command
            if not batch:                   # the lock was never taken: this call alone
                batch.extend(self._take(call, alone=True))
            _deliver(batch, [e] * len(batch))
        else:
            _deliver(batch, self.split(out, batch))

    def _take(self, call: _Call, *, alone: bool = False) -> list[_Call]:
        """`call` and the pending calls of its key, in arrival order, within max_rows rows and one call per owner;
        the rest wait for the next command (one of them leads it)."""
        with self._cond:
            batch, rows = [call], call.size
            owners = {call.owner} - {None}
            for other in self._pending:
                if (alone or other is call or call.key is None or other.key != call.key
                        or rows + other.size > self.max_rows or other.owner in owners):
                    continue
                batch.append(other)
                rows += other.size
                owners |= {other.owner} - {None}
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


class Coalescer(_Merger):
    """Runs log-prob command `name(prompts, responses, temperature, *extra)` for concurrent calls, merged up to
    `max_rows` rows a command (the trainer's request-size limit, actor.max_batch_size)."""

    def __init__(self, commands: Commands, name: str, *extra, max_rows: int):
        super().__init__(commands, name, max_rows=max_rows)
        self.extra = extra

    def logprobs(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                 temperature: float) -> list[list[float]]:
        """The command's answer for these rows (checked by the caller), run alone or merged with concurrent calls."""
        return self.submit(_Call((float(temperature),), ([list(p) for p in prompts], [list(r) for r in responses]),
                                 len(prompts)))

    def args(self, batch: list[_Call]) -> tuple:
        return (*_rows(batch), *batch[0].key, *self.extra)

    def split(self, out: list[list[float]], batch: list[_Call]) -> list[Any]:
        assert len(out) == sum(c.size for c in batch), "a merged command answered other rows"
        parts, start = [], 0
        for c in batch:
            parts.append(out[start:start + c.size])
            start += c.size
        return parts


class AdapterCoalescer(Coalescer):
    """The actor's log-prob calls, each under its adapter ("" = the run's; command adapter_logprobs): calls of one
    temperature merge, of different adapters too where `mixes` (the trainer runs rows of several adapters in one
    forward: updates/merged.py), else only calls of one adapter."""

    def __init__(self, commands: Commands, *, max_rows: int):
        super().__init__(commands, "adapter_logprobs", max_rows=max_rows)

    def adapter_logprobs(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                         temperature: float, adapter: str, *, mixes: bool) -> list[list[float]]:
        key = (float(temperature),) if mixes else (float(temperature), adapter)
        return self.submit(_Call(key, ([list(p) for p in prompts], [list(r) for r in responses], adapter),
                                 len(prompts)))

    def args(self, batch: list[_Call]) -> tuple:
        return (*_rows(batch), batch[0].key[0], [(c.payload[2], c.size) for c in batch])


def _rows(batch: list[_Call]) -> tuple[list, list]:
    """The prompts and the responses of a log-prob command's calls, in order."""
    return [p for c in batch for p in c.payload[0]], [r for c in batch for r in c.payload[1]]


class TrainMerger(_Merger):
    """TrainActor calls (command train_actors): concurrent calls of different adapters and one `key`
    (updates/merged.merge_key, None: alone) share one pass; the command gives each call its metrics or error.

    Runs on one trainer drift apart (one generates while another trains), so their calls seldom queue together by
    chance. A leader therefore waits a little for the adapters whose next call is due (`Cadence`: each adapter's
    calls come about one gap apart): at most `wait_passes` passes (actor.merge_wait_passes, default half a pass;
    GATHER_MAX_S at most), and only for calls expected within that time, so a run alone, or beside runs of another
    pace, waits for nothing. (On an H100, 4 runs, at half a pass: 3 of 10 waits caught a partner; the runs drift
    apart again after a merged pass: docs/many_runs.md.)"""

    def __init__(self, commands: Commands, *, wait_passes: float):
        super().__init__(commands, "train_actors", max_rows=float("inf"))
        self.wait_passes = wait_passes
        self.cadence = Cadence()
        self._pass_s = 0.0                  # the passes' seconds (a moving mean)
        self._started = 0.0
        self.stats.update(gathers=0, gather_timeouts=0)

    def train(self, samples: list[TrainSample], loss: ActorLoss, adapter: str, key: tuple | None) -> dict[str, float]:
        with self._cond:
            self.cadence.arrived(adapter, time.monotonic(), key)
        return self.submit(_Call(key, (samples, loss, adapter), len(samples), owner=adapter))

    def forget(self, adapter: str) -> None:
        """Adapter `adapter` is gone: no call of it is waited for."""
        with self._cond:
            self.cadence.forget(adapter)

    def _gather(self, call: _Call) -> None:
        if call.key is None:
            return
        with self._cond:
            within = min(GATHER_MAX_S, self.wait_passes * self._pass_s)
            if within <= 0:                 # no pass yet (nothing says how long one takes), or no waiting
                return
            here = self._owners(call.key)
            due = self.cadence.due(time.monotonic(), within, call.key) - here
            if not due:
                return
            self.stats["gathers"] += 1
            deadline = time.monotonic() + within
            while not due <= self._owners(call.key):
                left = deadline - time.monotonic()
                if left <= 0:
                    self.stats["gather_timeouts"] += 1
                    return
                self._cond.wait(left)

    def _owners(self, key: tuple) -> set:
        return {c.owner for c in self._pending if c.key == key}

    def args(self, batch: list[_Call]) -> tuple:
        self._started = time.monotonic()
        return ([c.payload for c in batch],)

    def split(self, out: list[Any], batch: list[_Call]) -> list[Any]:
        assert len(out) == len(batch), "a merged update answered other calls"
        took = time.monotonic() - self._started
        self._pass_s = took if not self._pass_s else 0.5 * (self._pass_s + took)
        return out


# The longest a TrainActor call waits for others due to join its pass (seconds).
GATHER_MAX_S = 1.0


class Cadence:
    """When each adapter's calls come: its last arrival and the gap before it."""

    def __init__(self):
        self.last: dict[Any, float] = {}
        self.interval: dict[Any, float] = {}
        self.keys: dict[Any, Any] = {}      # the key of each owner's last call: only calls of one key merge

    def arrived(self, owner: Any, now: float, key: Any = None) -> None:
        if owner in self.last:              # the last gap: a run's first steps after an idle spell count at once
            self.interval[owner] = now - self.last[owner]
        self.last[owner] = now
        self.keys[owner] = key

    def due(self, now: float, within: float, key: Any = None) -> set:
        """The owners of calls of `key` whose next call is expected within `within` seconds from `now` (or is up to
        half an interval late: an owner later than that may have stopped)."""
        out = set()
        for owner, last in self.last.items():
            gap = self.interval.get(owner)
            if gap is not None and self.keys.get(owner) == key and -0.5 * gap <= last + gap - now <= within:
                out.add(owner)
        return out

    def forget(self, owner: Any) -> None:
        self.last.pop(owner, None)
        self.interval.pop(owner, None)
        self.keys.pop(owner, None)


def _deliver(batch: list[_Call], answers: list[Any]) -> None:
    """Hands each call of a command its own answer, or its error."""
    for c, answer in zip(batch, answers):
        if isinstance(answer, BaseException):
            c.error = answer
        else:
            c.result = answer
        c.done.set()
