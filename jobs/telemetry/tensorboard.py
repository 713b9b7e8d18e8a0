"""metrics.jsonl's scalars also to TensorBoard (`metrics.tensorboard=true`): rank 0 writes RUN_DIR/tensorboard.

TensorBoard is an optional dependency (`pip install tensorboard`, or the `tensorboard` extra);
`check_tensorboard` is the config check that names the fix when it is asked for and missing.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

__all__ = ["check_tensorboard", "ScalarLog", "SKIPPED"]

SKIPPED = ("step", "time", "restart", "attempt", "stop")  # record fields that are not curves


def check_tensorboard(enabled: bool) -> None:
    """ValueError naming both fixes when metrics.tensorboard=true and the package is not importable."""
    if enabled and importlib.util.find_spec("tensorboard") is None:
        raise ValueError(
            "metrics.tensorboard=true needs the tensorboard package, which is not installed: "
            "pip install tensorboard (or pip install 'meshjob[tensorboard]'), or set metrics.tensorboard=false"
        )


class ScalarLog:
    """One SummaryWriter; `write(record)` adds every finite number of a metrics.jsonl record at its step.

    A restarted attempt trains again the steps after its checkpoint: `purge_step` (the step resumed from
    + 1, set before the first write) makes TensorBoard drop the earlier attempt's events at and after it,
    so each curve holds one value per step. The writer is opened at the first write, when it is known."""

    def __init__(self, run_dir: str | os.PathLike[str], *, purge_step: int | None = None) -> None:
        self.log_dir = str(Path(run_dir) / "tensorboard")
        self.purge_step = purge_step
        self.writer = None

    def write(self, record: dict) -> None:
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=self.log_dir, purge_step=self.purge_step)
        step = int(record["step"])
        for k, v in record.items():
            if k not in SKIPPED and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                self.writer.add_scalar(k, v, step, walltime=record.get("time"))
        self.writer.flush()  # readable while the run goes on (one flush per logged step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
