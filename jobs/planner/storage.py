"""Calibration's save-path probes: the host copy bandwidth (an async save's staging copy) and the run
filesystem's write bandwidth and write + fsync + rename cost."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from jobs.planner.timing import timed

__all__ = ["fs_write_and_commit", "host_copy_GBps"]


def host_copy_GBps(seconds: float) -> float:
    """Device-to-host (CUDA, pinned) or host memory copy bandwidth: what an async save's staging copy moves at."""
    import torch

    n = 64 * 2**20
    if torch.cuda.is_available():
        src, dst = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, pin_memory=True)
        sync = torch.cuda.synchronize
    else:
        src, dst, sync = torch.ones(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8), (lambda: None)
    return n / timed(lambda: dst.copy_(src), seconds=seconds, sync=sync) / 1e9


def fs_write_and_commit(run_root: str, seconds: float) -> tuple[float, float]:
    """(write GB/s of a 64 MiB file with fsync, seconds of a small write + fsync + rename) on `run_root`."""
    root = Path(run_root)
    root.mkdir(parents=True, exist_ok=True)
    data = os.urandom(64 * 2**20)
    with tempfile.TemporaryDirectory(dir=root, prefix=".calibrate-") as d:
        big, small, final = Path(d) / "big", Path(d) / "small.tmp", Path(d) / "small"

        def write(path: Path, payload: bytes) -> None:
            with open(path, "wb") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())

        bw = len(data) / timed(lambda: write(big, data), seconds=seconds, sync=lambda: None) / 1e9
        commit = timed(lambda: (write(small, b"{}"), os.replace(small, final)), seconds=seconds / 2, sync=lambda: None)
    return bw, commit
