"""A real coordinator server on its own event-loop thread whose run store is seeded with given records and metric
streams: for the CLI's views and commands of runs in a known state, without starting any other service."""

from __future__ import annotations

import asyncio
import threading

from coordinator.runapi.service import CoordinatorSettings, start as start_coordinator
from coordinator.runapi.store import RunRecord
from services.common.config import load_config


class StoredCoordinator:
    """`with StoredCoordinator(records, metrics) as address:` serves the records (and each run's metrics); `config`:
    the coordinator's own (its default pools: `{"rollout": {"servers": [...]}}`)."""

    def __init__(self, records: list[RunRecord], metrics: dict[str, list[dict]] | None = None,
                 config: dict | None = None):
        self.records, self.metrics, self.config = records, metrics or {}, config or {}

    def __enter__(self) -> str:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        return asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)

    async def _start(self) -> str:
        self.server, port, self.engine = await start_coordinator(load_config(CoordinatorSettings, data=self.config),
                                                                 "127.0.0.1:0")
        store = self.engine.manager.store
        for record in self.records:
            await store.put(record)
        for run_id, records in self.metrics.items():
            for m in records:
                await store.append_metrics(run_id, m)
        return f"127.0.0.1:{port}"

    def __exit__(self, *exc) -> None:
        async def stop():
            await self.engine.close()
            await self.server.stop(0)
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
