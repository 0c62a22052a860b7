"""Restoring a run's trainer from its newest checkpoint that loads: a damaged one falls back to the one before.

A run checkpoints into `<run_dir>/checkpoints/step_<N>`; the record keeps the newest (path, step, data position).
When the trainer refuses that one (a missing manifest: the save never finished; a file that differs from its
manifest; the folder is gone), the earlier `step_<M>` folders are tried newest first, each with the data position
step M recorded in its metrics. Falling back is said twice: a WARNING log line per refused checkpoint and the
run's message (the note returned). When none loads, the newest refusal is raised (CheckpointFailed: the run pauses naming it).

A new run may start from another run's checkpoint (`run.init_from`): `resolve_init_from` finds it by run id or
folder before the run starts.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from coordinator.runapi.store import RunRecord, RunStore
from coordinator.training import remote
from coordinator.training.context import CheckpointFailed, RunContext
from services.trainer.types import RunStep

log = logging.getLogger("meshrl.runs")

STEP_DIR = re.compile(r"step_(\d+)")


def earlier_checkpoints(run_dir: Path, before_step: int) -> list[tuple[int, Path]]:
    """The run's checkpoint folders of steps before `before_step`, newest first."""
    found = [(int(m.group(1)), p) for p in (run_dir / "checkpoints").glob("step_*")
             if (m := STEP_DIR.fullmatch(p.name)) and int(m.group(1)) < before_step and p.is_dir()]
    return sorted(found, reverse=True)


async def _candidates(store: RunStore, record: RunRecord, run_dir: Path):
    """(step, path, data position) of the record's newest checkpoint, then of the earlier ones whose step has
    its data position in the run's stored metrics, newest first (the metrics are read only if asked for)."""
    yield record.checkpoint_step, record.checkpoint_path, record.checkpoint_data_position
    positions = {int(m["step"]): int(m["data_position"]) for m in await store.metrics(record.run_id)
                 if "data_position" in m}
    for step, path in earlier_checkpoints(run_dir, record.checkpoint_step):
        if step in positions:
            yield step, str(path), positions[step]


async def restore_latest(store: RunStore, record: RunRecord, ctx: RunContext):
    """Loads the newest checkpoint the trainer accepts; -> (LoadCheckpoint answer, step, data position, note).

    When it is not the newest, `record`'s checkpoint fields name the one loaded and the note says why."""
    newest, refused = record.checkpoint_path, None
    async for step, path, position in _candidates(store, record, ctx.run_dir):
        try:
            restored = await remote.load_checkpoint(ctx.trainer, path, RunStep(record.run_id, step, position))
        except CheckpointFailed as e:
            log.warning("run %s: %s; trying the checkpoint before it", record.run_id, e)
            refused = refused or e
            continue
        if refused is None:
            return restored, step, position, ""
        log.warning("run %s: fell back from checkpoint %s to %s (step %d)", record.run_id, newest, path, step)
        record.checkpoint_path, record.checkpoint_step, record.checkpoint_data_position = path, step, position
        return restored, step, position, f"; {newest} was refused: {refused}"
    raise refused


MANIFEST = "manifest.json"      # written last by a save (services/trainer/model/checkpoint.py): the save finished


async def resolve_init_from(value: str, store: RunStore, run_dir: str) -> tuple[str, str]:
    """`run.init_from` as (checkpoint folder, where the run starts from in words); ("", "") when unset.

    A run id of this coordinator's store: that run's newest checkpoint; a run id with checkpoints under
    `run_dir/<id>/checkpoints` (a run of an earlier coordinator): the newest finished one; otherwise a checkpoint
    folder. Anything else is refused by name, before any service is called."""
    if not value:
        return "", ""
    record = await store.get(value)
    if record is not None:
        if not record.checkpoint_path:
            raise ValueError(f"run.init_from: run {value!r} has no checkpoint (it ran with run.checkpoint_every: 0, "
                             f"or before its first); set run.checkpoint_every on the run to start from")
        path = str(Path(record.checkpoint_path).resolve())
        return path, f"run {value}'s checkpoint of step {record.checkpoint_step} at {path}"
    finished = [(step, p) for step, p in earlier_checkpoints(Path(run_dir) / value, 2**62) if (p / MANIFEST).is_file()]
    if finished:
        step, path = finished[0]
        return str(path.resolve()), f"run {value}'s checkpoint of step {step} at {path.resolve()}"
    folder = Path(value)
    if (folder / MANIFEST).is_file():
        return str(folder.resolve()), f"checkpoint {folder.resolve()}"
    raise ValueError(f"run.init_from: {value!r} is neither a run (none by that id, no finished checkpoint under "
                     f"{Path(run_dir) / value / 'checkpoints'}) nor a checkpoint folder (no {MANIFEST} in it)")
