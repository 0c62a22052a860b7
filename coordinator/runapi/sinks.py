"""Where per-step metrics go besides the run store: TensorBoard event files, and wandb when configured."""

from __future__ import annotations

import logging
import math
from pathlib import Path

log = logging.getLogger("meshrl.sinks")


class MetricSinks:
    """TensorBoard events under <run_dir>/tensorboard; wandb when installed and `run.wandb_project` is set."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = True, wandb_project: str = "", run_name: str = "",
                 config: dict | None = None):
        self._tb = None
        self._wandb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
            except ImportError:
                log.info("tensorboard is not installed; no event files (pip install tensorboard)")
        if wandb_project:
            try:
                import wandb

                self._wandb = wandb.init(project=wandb_project, name=run_name, config=config or {}, reinit=True)
            except ImportError:
                log.warning("run.wandb_project is set but wandb is not installed (pip install wandb)")

    def write(self, step: int, metrics: dict[str, float]) -> None:
        scalars = {k: v for k, v in metrics.items() if k not in ("step", "timestamp") and math.isfinite(v)}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
