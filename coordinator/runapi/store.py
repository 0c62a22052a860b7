"""Run state stores: in memory (the embedded default) or Redis (survives a coordinator restart)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Protocol

RUN_STATES = ("PENDING", "RUNNING", "PAUSED", "COMPLETED", "FAILED", "STOPPED")
UNFINISHED = ("PENDING", "RUNNING", "PAUSED")


@dataclass
class RunRecord:
    """Everything needed to resume a run: config, step, data position, weight version, checkpoint, status."""

    run_id: str
    config: str                      # the YAML text it was started with (addresses filled in)
    state: str = "PENDING"
    step: int = 0
    num_steps: int = 0
    weight_version: int = 0
    data_position: int = 0
    checkpoint_path: str = ""
    # The run step whose weights checkpoint_path holds, and the data position after it: a trainer that lost its
    # weights is restored there and the run replays from that step on the same prompts (coordinator/runapi/recovery.py).
    checkpoint_step: int = 0
    checkpoint_data_position: int = 0
    message: str = ""
    run_dir: str = ""
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    last_metrics: dict = field(default_factory=dict)
    # Commands from the run API, read between steps: "", "pause", "stop".
    command: str = ""
    # The config it trains with, as YAML: `config` plus the running services' values of the keys fixed when a
    # service starts that it left out (coordinator/recipe/run_settings.py); secrets left out.
    effective_config: str = ""
    # Where the run's weights came from as it started: "model.path X (weights reloaded, ...)", "run Y's checkpoint
    # of step N (...)" (coordinator/runapi/runs.py).
    started_from: str = ""
    # The checkpoint run.init_from resolved to ("" : the run started from model.path): where a replay from step 0
    # starts again when the trainer lost the weights (coordinator/runapi/recovery.py).
    init_checkpoint: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RunRecord":
        return cls(**json.loads(text))


class RunStore(Protocol):
    async def put(self, record: RunRecord) -> None: ...
    async def get(self, run_id: str) -> RunRecord | None: ...
    async def list(self) -> list[RunRecord]: ...
    async def append_metrics(self, run_id: str, record: dict) -> None: ...
    async def commit(self, record: RunRecord, metrics: dict) -> None: ...
    async def rollback(self, record: RunRecord) -> None: ...
    async def metrics(self, run_id: str, from_step: int = 0) -> list[dict]: ...
    async def close(self) -> None: ...


class MemoryStore:
    """Run state in this process; lost when the coordinator stops."""

    def __init__(self):
        self._runs: dict[str, str] = {}
        self._metrics: dict[str, list[dict]] = {}
        self._lock = asyncio.Lock()

    async def put(self, record: RunRecord) -> None:
        record.updated_at = time.time()
        self._runs[record.run_id] = record.to_json()

    async def get(self, run_id: str) -> RunRecord | None:
        text = self._runs.get(run_id)
        return RunRecord.from_json(text) if text else None

    async def list(self) -> list[RunRecord]:
        return [RunRecord.from_json(t) for t in self._runs.values()]

    async def append_metrics(self, run_id: str, record: dict) -> None:
        self._metrics.setdefault(run_id, []).append(record)

    async def commit(self, record: RunRecord, metrics: dict) -> None:
        await self.append_metrics(record.run_id, metrics)
        await self.put(record)

    async def rollback(self, record: RunRecord) -> None:
        self._metrics[record.run_id] = [m for m in self._metrics.get(record.run_id, []) if m["step"] <= record.step]
        await self.put(record)

    async def metrics(self, run_id: str, from_step: int = 0) -> list[dict]:
        return [m for m in self._metrics.get(run_id, []) if m["step"] >= from_step]

    async def close(self) -> None:
        pass


# One step's commit: metrics appended and the record set in one atomic script. A commit retried after
# a lost reply (Redis restarted between applying it and answering) finds its metrics already last in the
# list and does not append them twice.
_COMMIT = """
if redis.call('LINDEX', KEYS[1], -1) ~= ARGV[1] then redis.call('RPUSH', KEYS[1], ARGV[1]) end
redis.call('SET', KEYS[2], ARGV[2])
redis.call('SADD', KEYS[3], ARGV[3])
return 1
"""

# A run set back to a checkpoint's step: the metrics of the steps after it (their updates are gone from the
# weights, and they run again) are dropped and the record set, in one atomic script.
_ROLLBACK = """
local items = redis.call('LRANGE', KEYS[1], 0, -1)
redis.call('DEL', KEYS[1])
for _, item in ipairs(items) do
  if cjson.decode(item)['step'] <= tonumber(ARGV[1]) then redis.call('RPUSH', KEYS[1], item) end
end
redis.call('SET', KEYS[2], ARGV[2])
return 1
"""


class RedisStore:
    """Run state in Redis: a JSON record per run and a list of per-step metric records.

    Durability is Redis's own: with AOF persistence (`appendfsync always`) every committed step
    survives a Redis crash. While Redis is away (a restart), calls retry for about `outage_s`
    seconds, so a run waits instead of failing.
    """

    def __init__(self, url: str, prefix: str = "meshrl", *, outage_s: float = 60.0):
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import ExponentialBackoff
        from redis.exceptions import ConnectionError, TimeoutError

        # Backoff capped at 1 s: about one retry a second once Redis has been gone for a while.
        retry = Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=max(1, int(outage_s)) + 5,
                      supported_errors=(ConnectionError, TimeoutError, ConnectionResetError, OSError))
        self._redis = aioredis.from_url(url, decode_responses=True, retry=retry,
                                        retry_on_error=[ConnectionError, TimeoutError, ConnectionResetError,
                                                        OSError])
        self._commit = self._redis.register_script(_COMMIT)
        self._rollback = self._redis.register_script(_ROLLBACK)
        self._prefix = prefix

    def _key(self, *parts: str) -> str:
        return ":".join((self._prefix, *parts))

    async def put(self, record: RunRecord) -> None:
        record.updated_at = time.time()
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(self._key("run", record.run_id), record.to_json())
            pipe.sadd(self._key("runs"), record.run_id)
            await pipe.execute()

    async def get(self, run_id: str) -> RunRecord | None:
        text = await self._redis.get(self._key("run", run_id))
        return RunRecord.from_json(text) if text else None

    async def list(self) -> list[RunRecord]:
        ids = sorted(await self._redis.smembers(self._key("runs")))
        out = []
        for run_id in ids:
            rec = await self.get(run_id)
            if rec:
                out.append(rec)
        return out

    async def append_metrics(self, run_id: str, record: dict) -> None:
        await self._redis.rpush(self._key("run", run_id, "metrics"), json.dumps(record))

    async def commit(self, record: RunRecord, metrics: dict) -> None:
        """A step's metrics and the run state that counts it land together (MULTI/EXEC), so a
        coordinator killed in between leaves neither a gap nor a repeated step."""
        record.updated_at = time.time()
        await self._commit(keys=[self._key("run", record.run_id, "metrics"), self._key("run", record.run_id),
                                 self._key("runs")],
                           args=[json.dumps(metrics), record.to_json(), record.run_id])

    async def rollback(self, record: RunRecord) -> None:
        """Metrics of steps after `record.step` dropped and the record set, atomically."""
        record.updated_at = time.time()
        await self._rollback(keys=[self._key("run", record.run_id, "metrics"), self._key("run", record.run_id)],
                             args=[record.step, record.to_json()])

    async def metrics(self, run_id: str, from_step: int = 0) -> list[dict]:
        items = await self._redis.lrange(self._key("run", run_id, "metrics"), 0, -1)
        return [m for m in map(json.loads, items) if m["step"] >= from_step]

    async def close(self) -> None:
        await self._redis.aclose()


def open_store(url: str, prefix: str = "meshrl") -> RunStore:
    return RedisStore(url, prefix=prefix) if url else MemoryStore()
