"""On a GPU: the device time of a rank's compute kernels per phase, NCCL's kernels left out.

A CUDA event pair around a phase (jobs/telemetry/phases.py) measures stream time: the phase's kernels plus every
wait of the stream on another (FSDP's all-gather stream, a collective's result). When one rank is slow, its peers'
collectives wait for it inside NCCL's kernels and their compute streams wait on those, so the healthy ranks' event
times grow by the straggler's excess and the peer comparison cannot tell them apart. NVIDIA's Resiliency Extension
times kernels with CUPTI and leaves NCCL's out for that reason. Here torch's profiler (Kineto over CUPTI) records one
step in every `metrics.kernel_every`, and each kernel counts for the phase whose range (a `record_function` the
timer opens, `PREFIX` + phase) holds the host time at which the op that launched it started: a kernel runs later
than its launch, and backward's ops launch on the autograd engine's thread while the main thread sits in its
backward range, so the host time, not the thread, decides. The link from kernel to op is torch's own (its
FunctionEvent tree is built the same way): a kernel's `linked_correlation_id` is the launching op's
`correlation_id`. A kernel whose name is NCCL's counts apart, as communication; copies and memsets count as
compute (device work of the rank's own).

`phase_device_seconds` is pure (tests feed it events); `from_kineto` is the one place that reads the profiler's
events, and only a GPU has kernels in them (on CPU the ranges and ops are real, the kernels absent).
"""

from __future__ import annotations

import bisect
import contextlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from jobs.log import get_logger

__all__ = ["PREFIX", "DeviceEvent", "is_comm_kernel", "phase_device_seconds", "from_kineto", "KernelSampler"]

PREFIX = "meshjob.phase."  # the record_function name of a phase's range
_COMM = re.compile(r"nccl", re.IGNORECASE)  # ncclDevKernel_AllGather_RING_LL, ncclKernel_..., ncclDevKernel_SendRecv
_DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # Kineto activity types that occupy the device


@dataclass(frozen=True, slots=True)
class DeviceEvent:
    kind: str  # "range" (a phase's record_function), "op" (a host op, may launch kernels), "kernel" (device work)
    name: str  # the phase (range), the op's or the kernel's name
    start_ns: int
    dur_ns: int
    corr: int  # op: its correlation id; kernel: the launching op's (linked_correlation_id); range: 0


def is_comm_kernel(name: str) -> bool:
    return bool(_COMM.search(name))


def phase_device_seconds(
    events: Iterable[DeviceEvent], names: Sequence[str]
) -> tuple[dict[str, float], dict[str, float]]:
    """({phase: compute kernel seconds}, {phase: NCCL kernel seconds}) of one profiled step. A kernel belongs to the
    innermost phase range open at its launching op's host start; one launched outside every range, or by an op the
    trace does not hold, counts nowhere."""
    events = list(events)
    phase_at = _Ranges([e for e in events if e.kind == "range"])
    launched = {e.corr: e.start_ns for e in events if e.kind == "op"}
    compute, comm = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0)
    for k in (e for e in events if e.kind == "kernel"):
        t = launched.get(k.corr)
        phase = None if t is None else phase_at(t)
        if phase in compute:
            (comm if is_comm_kernel(k.name) else compute)[phase] += k.dur_ns / 1e9
    return compute, comm


class _Ranges:
    """The phase ranges of one thread's context managers (nested or disjoint, never crossing): `(t)` is the innermost
    one open at host time t, by one bisection and a walk up the enclosing ranges."""

    def __init__(self, ranges: list[DeviceEvent]) -> None:
        self._r = sorted(((e.start_ns, e.start_ns + e.dur_ns, e.name) for e in ranges), key=lambda r: (r[0], -r[1]))
        self._starts = [r[0] for r in self._r]
        self._parent: list[int] = []
        open_: list[int] = []
        for i, (start, _, _) in enumerate(self._r):
            while open_ and self._r[open_[-1]][1] < start:
                open_.pop()
            self._parent.append(open_[-1] if open_ else -1)
            open_.append(i)

    def __call__(self, t: int) -> str | None:
        i = bisect.bisect_right(self._starts, t) - 1
        while i >= 0 and self._r[i][1] < t:
            i = self._parent[i]
        return self._r[i][2] if i >= 0 else None


def from_kineto(events: Iterable[Any]) -> list[DeviceEvent]:
    """The profiler's events (`profile.profiler.kineto_results.events()`, torch._C._autograd._KinetoEvent) that
    `phase_device_seconds` needs: the phases' ranges, the host ops (correlation ids), the device work."""
    out = []
    for e in events:
        kind, name = e.activity_type(), e.name()
        if kind == "user_annotation" and name.startswith(PREFIX):
            out.append(DeviceEvent("range", name[len(PREFIX) :], e.start_ns(), e.duration_ns(), 0))
        elif kind == "cpu_op":
            out.append(DeviceEvent("op", name, e.start_ns(), e.duration_ns(), e.correlation_id()))
        elif kind in _DEVICE_WORK:
            out.append(DeviceEvent("kernel", name, e.start_ns(), e.duration_ns(), e.linked_correlation_id()))
    return out


class KernelSampler:
    """Profiles one step in every `every` (`begin` before its first phase, `end` after its last) and gives its
    compute kernel seconds per phase. `activities`: the profiler's (CPU + CUDA on a GPU; tests on CPU pass CPU)."""

    def __init__(self, every: int, *, activities: Sequence[Any] | None = None) -> None:
        if every < 1:
            raise ValueError(f"metrics.kernel_every={every}: profile one step in every N >= 1 (0 turns it off)")
        self.every, self._activities = every, activities
        self._prof: Any = None
        self._warned = False
        self.comm_s: dict[str, float] = {}  # the last profiled step's NCCL kernel seconds per phase
        self.trace_events, self.phases_seen = 0, ()  # the last profiled step's trace: its size, its phase ranges

    @property
    def active(self) -> bool:
        return self._prof is not None

    def begin(self) -> None:
        """Starts profiling the step. A profiler that cannot start (one of the user's is already running) leaves the
        step unprofiled, with one warning: a window without a profiled step is not judged."""
        from torch.profiler import ProfilerActivity, profile

        acts = list(self._activities or (ProfilerActivity.CPU, ProfilerActivity.CUDA))
        prof = profile(activities=acts, record_shapes=False, profile_memory=False, with_stack=False)
        try:
            prof.start()
        except RuntimeError as e:
            if not self._warned:
                self._warned = True
                get_logger().warning(
                    "metrics.kernel_every: the profiler did not start (%s); steps it cannot profile "
                    "are not judged for stragglers",
                    e,
                )
            return
        self._prof = prof

    def range(self, name: str) -> contextlib.AbstractContextManager:
        if self._prof is None:
            return contextlib.nullcontext()
        from torch.profiler import record_function

        return record_function(PREFIX + name)

    def end(self, names: Sequence[str]) -> list[float]:
        """Stops the profiler (it waits for the device: a kernel still queued would be missing) and returns the
        step's compute kernel seconds in the order of `names`."""
        prof, self._prof = self._prof, None
        prof.stop()
        events = self._events(prof)
        self.trace_events, self.phases_seen = len(events), tuple(e.name for e in events if e.kind == "range")
        compute, self.comm_s = phase_device_seconds(events, names)
        return [compute[n] for n in names]

    def _events(self, prof: Any) -> list[DeviceEvent]:
        """A stopped profiler's events (the seam tests on CPU widen with kernels, which only a GPU records)."""
        return from_kineto(prof.profiler.kineto_results.events())

    def cancel(self) -> None:
        """Stops a profiled step that will not end (rolled back) without reading it."""
        prof, self._prof = self._prof, None
        if prof is not None:
            prof.stop()
