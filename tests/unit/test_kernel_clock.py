"""The GPU straggler clock: compute kernels' device time per phase, NCCL's left out, from one
profiled step in every metrics.kernel_every (jobs/telemetry/kernels.py).

On CPU the profiler records the phases' ranges and the host ops for real but no kernel: the kernels here are
synthetic events linked to real ops' correlation ids (KernelSampler._events, the one seam), as a GPU's trace links
them. tests/gpu/test_gpu_phases.py runs the whole path on a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity

from jobs.config import compose
from jobs.telemetry.kernels import DeviceEvent, KernelSampler, is_comm_kernel, phase_device_seconds
from jobs.telemetry.phases import PhaseTimer
from jobs.validate import validate
from tests.unit.test_stragglers import _FakeEvent

MS = 1_000_000  # ns


def _ev(kind: str, name: str, start_ms: float, dur_ms: float, corr: int = 0) -> DeviceEvent:
    return DeviceEvent(kind, name, int(start_ms * MS), int(dur_ms * MS), corr)


def test_a_kernel_counts_for_the_phase_its_launching_op_started_in_and_nccl_counts_apart() -> None:
    events = [
        _ev("range", "forward", 0, 10),
        _ev("range", "backward", 10, 30),
        _ev("range", "optimizer", 45, 5),
        _ev("op", "aten::mm", 1, 1, corr=1),  # forward, main thread
        _ev("op", "aten::mm", 12, 1, corr=2),  # backward, on the autograd engine's thread: its host time decides
        _ev("op", "c10d::allgather_", 14, 1, corr=3),  # FSDP's all-gather, launched in backward
        _ev("op", "aten::add", 41, 1, corr=4),  # between the ranges: no phase
        _ev("op", "aten::_foreach_add", 46, 1, corr=5),
        # kernels run after their launch, past the end of their phase's host range
        _ev("kernel", "sm90_xmma_gemm_bf16", 15, 3, corr=1),
        _ev("kernel", "sm90_xmma_gemm_bf16", 35, 7, corr=2),
        _ev("kernel", "ncclDevKernel_AllGather_RING_LL", 36, 20, corr=3),  # waits for a slow peer inside NCCL
        _ev("kernel", "Memcpy DtoD", 57, 1, corr=4),
        _ev("kernel", "multi_tensor_apply_kernel", 60, 2, corr=5),
        _ev("kernel", "orphan", 61, 9, corr=99),  # its op is not in the trace
    ]
    compute, comm = phase_device_seconds(events, ["forward", "backward", "collective", "optimizer"])
    assert compute == pytest.approx({"forward": 0.003, "backward": 0.007, "collective": 0.0, "optimizer": 0.002})
    assert comm == pytest.approx({"forward": 0.0, "backward": 0.020, "collective": 0.0, "optimizer": 0.0})
    assert is_comm_kernel("ncclKernel_SendRecv") and not is_comm_kernel("ampere_bf16_s16816gemm")


def test_a_kernel_launched_in_a_nested_range_counts_for_the_innermost_one_open() -> None:
    events = [
        _ev("range", "pp_step", 0, 100),
        _ev("range", "forward", 10, 10),
        _ev("range", "backward", 30, 10),
        _ev("op", "a", 15, 1, corr=1),
        _ev("op", "b", 25, 1, corr=2),
        _ev("op", "c", 35, 1, corr=3),
        _ev("op", "d", 120, 1, corr=4),
    ]
    events += [_ev("kernel", "k", 200, 1, corr=c) for c in (1, 2, 3, 4)]
    compute, _ = phase_device_seconds(events, ["pp_step", "forward", "backward"])
    assert compute == pytest.approx({"pp_step": 0.001, "forward": 0.001, "backward": 0.001})


class _Kernels(KernelSampler):
    """A KernelSampler on the CPU profiler whose trace gains one kernel per aten::mm (a GPU's gemm), and an NCCL
    kernel per all-reduce, each linked to its real op: the seam a GPU fills with CUPTI's kernels."""

    def __init__(self, every: int, kernel_ms: float = 2.0) -> None:
        super().__init__(every, activities=[ProfilerActivity.CPU])
        self.kernel_ms = kernel_ms
        self.seen: list[list[DeviceEvent]] = []

    def _events(self, prof) -> list[DeviceEvent]:
        real = super()._events(prof)
        fake = [
            _ev(
                "kernel",
                "nccl" if "all_reduce" in e.name else "gemm",
                e.start_ns / MS + 50,
                self.kernel_ms,
                corr=e.corr,
            )
            for e in real
            if e.kind == "op" and e.name in ("aten::mm", "c10d::allreduce_")
        ]
        self.seen.append(real)
        return real + fake


def test_the_real_profiler_gives_the_phase_ranges_and_the_ops_correlation_ids_the_kernels_link_to() -> None:
    k = _Kernels(every=1)
    x = torch.randn(32, 32, requires_grad=True)
    k.begin()
    with k.range("forward"):
        y = (x @ x).sum()
    with k.range("backward"):
        y.backward()  # mm backward: two more mm
    row = k.end(["forward", "backward", "optimizer"])
    (real,) = k.seen
    assert [e.name for e in real if e.kind == "range"] == ["forward", "backward"]
    ops = [e for e in real if e.kind == "op"]
    assert len({e.corr for e in ops}) == len(ops) and all(e.corr > 0 for e in ops)  # what a kernel links to
    assert row == pytest.approx([0.002, 0.004, 0.0])  # one gemm forward, two backward
    assert not k.active


def _timer(tmp_path: Path, monkeypatch, kernels: KernelSampler | None) -> PhaseTimer:
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(_FakeEvent, "synced", [])  # the fake clock's class state, left as other tests expect it
    monkeypatch.setattr(_FakeEvent, "clock_ms", 0.0)
    return PhaseTimer(tmp_path, rank=0, attempt="a", pp=False, device_type="cuda", kernels=kernels)


def test_on_cuda_the_straggler_rows_are_the_profiled_steps_kernel_time_and_the_file_keeps_event_time(
    tmp_path: Path, monkeypatch
) -> None:
    import h5py

    k = _Kernels(every=3, kernel_ms=2.0)
    t = _timer(tmp_path, monkeypatch, k)
    x = torch.randn(16, 16)
    for step in range(1, 8):
        with t.phase("forward"):
            x @ x
            _FakeEvent.clock_ms += 40.0  # stream time: the gemm plus a wait on a peer
        t.end_step(step)
    assert len(k.seen) == 3  # steps 1, 4, 7: one in every 3, the first included
    f = t.names.index("forward")
    assert t.take_interval()[f] == pytest.approx(0.002)  # the gemm's device time, not the 40 ms stream time
    t.flush()
    with h5py.File(tmp_path / "telemetry" / "rank0.h5", "r") as h:
        assert h["forward"][:].tolist() == pytest.approx([0.04] * 7)
    assert t.clock == "kernels"
    assert _timer(tmp_path / "b", monkeypatch, None).clock == "cuda"  # metrics.kernel_every=0


def test_a_rolled_back_profiled_step_stops_the_profiler_unread(tmp_path: Path, monkeypatch) -> None:
    k = _Kernels(every=1)
    t = _timer(tmp_path, monkeypatch, k)
    with t.phase("forward"):
        torch.ones(4) @ torch.ones(4)
    assert k.active
    t.drop_step()
    assert not k.active and k.seen == []
    with t.phase("forward"):
        pass
    t.end_step(1)
    assert len(k.seen) == 1 and t.take_interval()[t.names.index("forward")] == 0.0


def test_kernel_every_is_checked_before_anything_runs() -> None:
    with pytest.raises(ValueError, match=r"metrics.kernel_every\(21\) must be 0 .* or 1..20"):
        validate(compose(["mesh=single", "launcher.tasks_per_node=1", "metrics.kernel_every=21"]))
    validate(compose(["mesh=single", "launcher.tasks_per_node=1", "metrics.kernel_every=0"]))


def test_a_profiler_that_cannot_start_leaves_the_step_unprofiled_and_its_window_unjudged(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    import torch.profiler

    def refuse(self):
        raise RuntimeError("Profiler is already enabled")  # e.g. the user's own torch.profiler around training

    monkeypatch.setattr(torch.profiler.profile, "start", refuse)
    k = _Kernels(every=1)
    t = _timer(tmp_path, monkeypatch, k)
    for step in (1, 2):
        with t.phase("forward"):
            pass
        t.end_step(step)
    assert not k.active and k.seen == []
    assert torch.isnan(torch.as_tensor(t.take_interval())).all()  # nothing to judge, rather than event time
    assert sum("the profiler did not start" in r.message for r in caplog.records) == 1
