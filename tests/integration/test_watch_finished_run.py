"""`meshrl watch RUN_ID` of a run that has ended shows the run's whole metric stream: the held-out accuracy after
training (the last record, `final: 1`, at the same step as the last training step) as well as before, not a frame
drawn as soon as the last step's number came in."""

import asyncio
import io
import threading

from rich.console import Console

from coordinator.cli.watch import watch_run
from coordinator.client import Client
from coordinator.runapi.service import CoordinatorSettings, start as start_coordinator
from coordinator.runapi.store import RunRecord
from services.common.config import load_config

RUN = "arith-grpo-done"
METRICS = [{"step": 0, "heldout_accuracy": 0.325},
           *({"step": s, "reward_mean": 0.5, "accuracy": 0.5, "time/step": 0.4, "time/train": 0.2} for s in (1, 2, 3)),
           {"step": 3, "heldout_accuracy": 0.39, "final": 1.0}]


class Coordinator:
    """A real coordinator server on its own event loop thread, whose store holds one COMPLETED run."""

    def __enter__(self) -> str:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        return asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)

    async def _start(self) -> str:
        self.server, port, self.engine = await start_coordinator(load_config(CoordinatorSettings, data={}),
                                                                 "127.0.0.1:0")
        store = self.engine.manager.store
        await store.put(RunRecord(run_id=RUN, config="", state="COMPLETED", step=3, num_steps=3, weight_version=3,
                                  last_metrics={"reward_mean": 0.5}))
        for m in METRICS:
            await store.append_metrics(RUN, m)
        return f"127.0.0.1:{port}"

    def __exit__(self, *exc) -> None:
        async def stop():
            await self.engine.close()
            await self.server.stop(0)
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)


def test_watch_once_of_a_finished_run_shows_the_heldout_accuracy_after_training():
    with Coordinator() as address:
        for _ in range(3):          # each view drawn from the whole stream, every time
            out = io.StringIO()
            with Client(address) as client:
                watch_run(client, RUN, once=True, console=Console(file=out, width=120))
            held = next(line for line in out.getvalue().splitlines() if line.startswith("held-out"))
            assert held.split()[:2] == ["held-out", "0.390"], out.getvalue()


def test_the_live_watch_of_a_finished_run_ends_on_the_frame_with_the_heldout_accuracy_after():
    with Coordinator() as address:
        out = io.StringIO()
        with Client(address) as client:
            watch_run(client, RUN, console=Console(file=out, width=120))
        lines = out.getvalue().splitlines()
        held = [line for line in lines if line.startswith("held-out")]
        assert held and held[-1].split()[:2] == ["held-out", "0.390"], out.getvalue()
        assert lines[-1] == f"{RUN}: COMPLETED at step 3/3"
