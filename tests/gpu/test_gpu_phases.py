"""On CUDA: per-rank phase timing uses CUDA event pairs (jobs/telemetry/phases.py), read at the log
interval; the times land in the rank's HDF5 file, fit inside the measured step, and there is no
CPU-time column (that is the CPU ranks' clock).

Not yet run on a GPU: the session that wrote it had none (tests/unit/test_stragglers.py covers the
event path with a fake event clock)."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from tests.conftest import run_train

pytestmark = pytest.mark.gpu


def test_a_gpu_run_times_its_phases_with_cuda_events_and_they_fit_in_the_step(data_path: str, tmp_path: Path) -> None:
    run = run_train(["mesh=single", "launcher.tasks_per_node=1", "train.device=cuda", "train.steps=12",
                     "train.log_every=4", "checkpoint.enabled=false", f"data.path={data_path}"], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    with h5py.File(tmp_path / "telemetry" / "rank0.h5", "r") as f:
        assert "cpu" not in f  # event time is what the straggler checks judge on a GPU
        assert list(f["step"][:]) == list(range(1, 13))
        fwd, bwd, opt = f["forward"][:], f["backward"][:], f["optimizer"][:]
    assert (fwd > 0).all() and (bwd > 0).all() and (opt > 0).all()
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    step_s = np.median([m["step_time_s"] for m in steps if "step_time_s" in m])
    # stream time of the phases is part of the step's wall time (warm-up steps aside)
    assert np.median(fwd[4:] + bwd[4:] + opt[4:]) <= step_s * 1.05, (fwd, bwd, opt, step_s)
