"""On CUDA: per-rank phase timing uses CUDA event pairs (jobs/telemetry/phases.py), read at the log
interval; the times land in the rank's HDF5 file, fit inside the measured step, and there is no
CPU-time column (that is the CPU ranks' clock). The straggler checks judge the profiled steps' compute
kernels (jobs/telemetry/kernels.py): real CUPTI kernels credited to the phase that launched them, NCCL's
apart.

Not yet run on a GPU (tests/unit/test_stragglers.py covers the
event path with a fake event clock)."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from tests.conftest import run_train
from tests.multiproc._ranks import run_ranks

pytestmark = pytest.mark.gpu


def test_a_gpu_run_times_its_phases_with_cuda_events_and_they_fit_in_the_step(data_path: str, tmp_path: Path) -> None:
    run = run_train(
        [
            "mesh=single",
            "launcher.tasks_per_node=1",
            "train.device=cuda",
            "train.steps=12",
            "train.log_every=4",
            "checkpoint.enabled=false",
            f"data.path={data_path}",
        ],
        tmp_path,
    )
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


def _kernel_clock_rank(rank: int, world: int, tmp: str) -> dict:
    """One forked rank (CUDA stays uninitialised in pytest): a gemm in forward, an NCCL all-reduce in collective, one
    profiled step; its kernel row, the NCCL seconds and the event row."""
    import torch
    import torch.distributed as dist

    from jobs.telemetry.kernels import KernelSampler
    from jobs.telemetry.phases import PhaseTimer

    torch.cuda.set_device(0)
    nccl = dist.new_group(ranks=[0], backend="nccl")
    a = torch.randn(4096, 4096, device="cuda")
    dist.all_reduce(torch.ones(1 << 20, device="cuda"), group=nccl)  # NCCL's communicator set up before timing
    k = KernelSampler(1)
    t = PhaseTimer(tmp, rank=rank, attempt="a", pp=False, device_type="cuda", kernels=k)
    for step in (1, 2):
        with t.phase("forward"):
            for _ in range(8):
                a = (a @ a) / 64.0
        with t.phase("collective"):
            dist.all_reduce(torch.ones(1 << 24, device="cuda"), group=nccl)
        t.end_step(step)
    names = list(t.names)
    kernel_row = t.take_interval().tolist()
    t.flush()
    return {"names": names, "kernels": kernel_row, "comm": dict(k.comm_s), "clock": t.clock}


def test_the_gpu_straggler_clock_is_the_gemms_device_time_with_nccl_kernels_apart(tmp_path: Path) -> None:
    r = run_ranks(_kernel_clock_rank, 1, str(tmp_path), timeout=300).results[0]
    row = dict(zip(r["names"], r["kernels"]))
    with h5py.File(tmp_path / "telemetry" / "rank0.h5", "r") as f:
        event_fwd = float(np.median(f["forward"][:]))
    assert r["clock"] == "kernels"
    # 8 gemms of 4096^3 (1.1 TFLOP) take milliseconds; the kernel time is within the stream time of the phase
    assert 1e-4 < row["forward"] <= event_fwd * 1.02, (row, event_fwd)
    assert row["collective"] == 0.0, row  # the all-reduce's kernel is NCCL's: never compute
    print("kernel row", row, "nccl", r["comm"], "event forward", event_fwd)
