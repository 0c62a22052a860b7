"""Run state stores: in memory (the embedded default) or Redis (survives a coordinator restart)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Protocol

from coordinator.run_keys import UNFINISHED, redis_key


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
    # Its named adapter on the trainer when it runs beside other LoRA runs ("" = the trainer's run adapter;
    # coordinator/runapi/sharing.py).
    adapter: str = ""

    @property
    def pending_command(self) -> str:
        """The pause or stop asked for that lands after the step in flight ("" when none): a PAUSED run's "pause"
        has landed; a finished run has none."""
        if self.state not in UNFINISHED or self.command not in ("pause", "stop"):
            return ""
        return "" if self.command == "pause" and self.state == "PAUSED" else self.command

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
    def ledger(self, run_id: str) -> "Ledger": ...
    async def close(self) -> None: ...


# The async loop's ledger (coordinator/training/ledger.py writes it): one entry per prompt group in flight, keyed by
# the group's data position (its prompt's index in the run's prompt stream), {"state", "version", "step", ...}:
#   generating  launched at weight version `version` for step `step`;
#   generated   its samples are kept beside it (`version`: their oldest token's);
#   scored      taken by step `step`, which trains on it;  dropped: taken by step `step`, too stale, not trained;
#   filtered    taken by step `step`, left out by algorithm.filter_groups.
# A step's commit settles, in the same atomic write as its metrics and record, every entry below the data position
# it commits: they leave the live ledger for the step's line of the settled log, {"step", "trained": [positions],
# "dropped": [...], "filtered": [...], "unsettled": [...]} (keys with no position left out; `unsettled`: an entry
# the step did not take, which exactly-once never leaves). So a group is marked trained exactly when its step is.
SETTLED = {"scored": "trained", "dropped": "dropped", "filtered": "filtered"}


def settle(live: dict[int, str], step: int, position: int, finished: bool) -> tuple[dict | None, list[int]]:
    """The settled-log line of a commit of `step` at data position `position` and the live positions it removes
    (those below `position`, and every one when the run finished); _COMMIT does the same in Lua."""
    marks: dict[str, list[int]] = {}
    gone = []
    for p, text in sorted(live.items()):
        if p < position:
            entry = json.loads(text)
            bucket = SETTLED.get(entry["state"], "unsettled") if entry.get("step") == step else "unsettled"
            marks.setdefault(bucket, []).append(p)
        if p < position or finished:
            gone.append(p)
    return ({"step": step, **marks} if marks else None), gone


class Ledger(Protocol):
    async def put(self, entries: dict[int, dict], samples: dict[int, str] | None = None) -> None: ...
    async def live(self) -> dict[int, tuple[dict, str | None]]: ...
    async def settled(self) -> list[dict]: ...


class MemoryLedger:
    """A run's ledger in this process (MemoryStore): settled by MemoryStore.commit."""

    def __init__(self):
        self.entries: dict[int, str] = {}
        self.samples: dict[int, str] = {}
        self.log: list[dict] = []

    async def put(self, entries: dict[int, dict], samples: dict[int, str] | None = None) -> None:
        self.entries.update({p: json.dumps(e) for p, e in entries.items()})
        self.samples.update(samples or {})

    async def live(self) -> dict[int, tuple[dict, str | None]]:
        return {p: (json.loads(e), self.samples.get(p)) for p, e in sorted(self.entries.items())}

    async def settled(self) -> list[dict]:
        return list(self.log)

    def commit(self, step: int, position: int, finished: bool) -> None:
        line, gone = settle(self.entries, step, position, finished)
        for p in gone:
            self.entries.pop(p, None)
            self.samples.pop(p, None)
        if line:
            self.log.append(line)

    def rollback(self, step: int) -> None:
        self.entries.clear()
        self.samples.clear()
        self.log = [line for line in self.log if line["step"] <= step]


class MemoryStore:
    """Run state in this process; lost when the coordinator stops."""

    def __init__(self):
        self._runs: dict[str, str] = {}
        self._metrics: dict[str, list[dict]] = {}
        self._ledgers: dict[str, MemoryLedger] = {}
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
        self.ledger(record.run_id).commit(int(metrics["step"]), record.data_position,
                                          record.state not in UNFINISHED)
        await self.put(record)

    async def rollback(self, record: RunRecord) -> None:
        self._metrics[record.run_id] = [m for m in self._metrics.get(record.run_id, []) if m["step"] <= record.step]
        self.ledger(record.run_id).rollback(record.step)
        await self.put(record)

    def ledger(self, run_id: str) -> MemoryLedger:
        return self._ledgers.setdefault(run_id, MemoryLedger())

    async def metrics(self, run_id: str, from_step: int = 0) -> list[dict]:
        return [m for m in self._metrics.get(run_id, []) if m["step"] >= from_step]

    async def close(self) -> None:
        pass


# One step's commit: metrics appended, the async ledger's entries below the committed data position settled (see
# `settle`, which this mirrors) and the record set, in one atomic script. A commit retried after a lost reply (Redis
# restarted between applying it and answering) finds its metrics already last in the list and does neither twice.
# KEYS: metrics, run, runs, ledger, ledger samples, settled log; ARGV: metrics, record, run id, step, data
# position, "1" when the run finished (its ledger is emptied).
_COMMIT = """
if redis.call('LINDEX', KEYS[1], -1) ~= ARGV[1] then
  redis.call('RPUSH', KEYS[1], ARGV[1])
  local step, position, finished = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6] == '1'
  local settled = {scored = 'trained', dropped = 'dropped', filtered = 'filtered'}
  local live = redis.call('HGETALL', KEYS[4])
  local marks, n = {}, 0
  for i = 1, #live, 2 do
    local p = tonumber(live[i])
    if p < position then
      local entry = cjson.decode(live[i + 1])
      local bucket = 'unsettled'
      if entry['step'] == step and settled[entry['state']] then bucket = settled[entry['state']] end
      marks[bucket] = marks[bucket] or {}
      table.insert(marks[bucket], p)
      n = n + 1
    end
    if p < position or finished then
      redis.call('HDEL', KEYS[4], live[i])
      redis.call('HDEL', KEYS[5], live[i])
    end
  end
  if n > 0 then
    for _, ps in pairs(marks) do table.sort(ps) end
    marks['step'] = step
    redis.call('RPUSH', KEYS[6], cjson.encode(marks))
  end
end
redis.call('SET', KEYS[2], ARGV[2])
redis.call('SADD', KEYS[3], ARGV[3])
return 1
"""

# A run set back to a checkpoint's step: the metrics and the ledger's settled lines of the steps after it (their
# updates are gone from the weights, and they run again on the same prompts) are dropped, the live ledger emptied
# (what was in flight is generated again) and the record set, in one atomic script.
_ROLLBACK = """
for _, key in ipairs({KEYS[1], KEYS[5]}) do
  local items = redis.call('LRANGE', key, 0, -1)
  redis.call('DEL', key)
  for _, item in ipairs(items) do
    if cjson.decode(item)['step'] <= tonumber(ARGV[1]) then redis.call('RPUSH', key, item) end
  end
end
redis.call('DEL', KEYS[3], KEYS[4])
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
        return redis_key(self._prefix, *parts)

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
        ledger = self.ledger(record.run_id)
        await self._commit(keys=[self._key("run", record.run_id, "metrics"), self._key("run", record.run_id),
                                 self._key("runs"), *ledger.keys],
                           args=[json.dumps(metrics), record.to_json(), record.run_id, int(metrics["step"]),
                                 record.data_position, int(record.state not in UNFINISHED)])

    async def rollback(self, record: RunRecord) -> None:
        """Metrics of steps after `record.step` dropped and the record set, atomically."""
        record.updated_at = time.time()
        ledger = self.ledger(record.run_id)
        await self._rollback(keys=[self._key("run", record.run_id, "metrics"), self._key("run", record.run_id),
                                   *ledger.keys], args=[record.step, record.to_json()])

    def ledger(self, run_id: str) -> "RedisLedger":
        return RedisLedger(self._redis, self._key("run", run_id, "ledger"))

    async def metrics(self, run_id: str, from_step: int = 0) -> list[dict]:
        items = await self._redis.lrange(self._key("run", run_id, "metrics"), 0, -1)
        return [m for m in map(json.loads, items) if m["step"] >= from_step]

    async def close(self) -> None:
        await self._redis.aclose()


class RedisLedger:
    """A run's ledger in Redis: live entries (a hash by data position), the samples of generated groups (a hash
    beside it, so reading the states stays cheap) and the settled log (a list, one line per step); settled by
    RedisStore.commit's script."""

    def __init__(self, redis, key: str):
        self._redis = redis
        self.keys = (key, f"{key}:samples", f"{key}:settled")

    async def put(self, entries: dict[int, dict], samples: dict[int, str] | None = None) -> None:
        # An entry and its samples land together: a generated entry always has them.
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys[0], mapping={str(p): json.dumps(e) for p, e in entries.items()})
            if samples:
                pipe.hset(self.keys[1], mapping={str(p): text for p, text in samples.items()})
            await pipe.execute()

    async def live(self) -> dict[int, tuple[dict, str | None]]:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(self.keys[0])
            pipe.hgetall(self.keys[1])
            entries, samples = await pipe.execute()
        return {int(p): (json.loads(e), samples.get(p)) for p, e in sorted(entries.items(), key=lambda i: int(i[0]))}

    async def settled(self) -> list[dict]:
        return [json.loads(line) for line in await self._redis.lrange(self.keys[2], 0, -1)]


def open_store(url: str, prefix: str = "meshrl") -> RunStore:
    return RedisStore(url, prefix=prefix) if url else MemoryStore()
