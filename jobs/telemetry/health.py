"""GPU health through NVML: each rank checks its own GPU at start and every `failure.health_every_s`.

A failing check means the GPU slows every rank or its memory cannot be trusted; it becomes an
`unhealthy_gpu` incident naming the GPU (UUID, PCI bus id) and the node, which requeues the job
with that node quarantined (`jobs.failure.respond`). A warning is only a `gpu_health` event.

| check (NVML call) | failing | warning |
|---|---|---|
| clock events (`nvmlDeviceGetCurrentClocksEventReasons`) | HW slowdown, HW thermal, HW power brake, SW thermal | SW power cap (the board at its power limit: normal under load) |
| temperature (`nvmlDeviceGetTemperature`) | - (a hot GPU that is not throttled yet) | >= `failure.health_temp_warn_c` |
| volatile uncorrected ECC errors (`nvmlDeviceGetTotalEccErrors`) | > 0 since the driver loaded | - |
| remapped rows (`nvmlDeviceGetRemappedRows`, Ampere and later) | a remap pending (needs a GPU reset) or a remap failure | - |
| retired pages (`nvmlDeviceGetRetiredPagesPendingStatus`, before Ampere) | a retirement pending | - |
| XID events (`nvmlEventSetWait_v2`, where the driver delivers them) | an XID in `failure.health_failing_xids` | any other XID (13, 31, 43: usually the program's own fault) |

A clock event fails the GPU only when CLOCK_EVENT_SAMPLES consecutive samples show it (until then it
is a warning saying which sample it is): one sample is a moment, and a brief HW slowdown or thermal
event must not end a job. At start the samples are taken CONFIRM_S apart, so a GPU that stays
throttled still never joins the rendezvous; later ones come every `failure.health_every_s`. ECC,
row-remap, page-retirement, XID and lost-GPU findings are states or events, failing at once.

A check that NVML does not support on this GPU is left out (the start event lists it as
`unsupported`). No nvidia-ml-py, no NVML library or a CPU run: nothing is checked, and rank 0 writes
one `gpu_health` event `no GPU: skipped (<why>)`.

The rank's GPU is found by UUID, then PCI bus id, from torch's device properties: they already
reflect CUDA_VISIBLE_DEVICES (indices, UUIDs or MIG ids) and CUDA_DEVICE_ORDER, and NVML's index
is not CUDA's ordinal. The seam: `Nvml`, the few NVML calls used; `PynvmlNvml` makes them through
pynvml, tests pass a fake.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from jobs.config import FailureConfig
from jobs.failure.incident import Incident
from jobs.log import get_logger

__all__ = [
    "GpuId",
    "Nvml",
    "NotSupported",
    "PynvmlNvml",
    "Sample",
    "Finding",
    "GpuHealth",
    "open_nvml",
    "cuda_gpu",
    "read_sample",
    "assess",
    "CLOCK_EVENTS",
    "CLOCK_EVENT_SAMPLES",
    "GpuLost",
    "rank_health",
]

# nvmlClocksEventReason* bits: name, failing?
CLOCK_EVENTS = {
    0x8: ("hw_slowdown", True),
    0x40: ("hw_thermal_slowdown", True),
    0x80: ("hw_power_brake_slowdown", True),
    0x20: ("sw_thermal_slowdown", True),
    0x4: ("sw_power_cap", False),
}

CLOCK_EVENT_SAMPLES = 3  # consecutive samples with a failing clock event before the GPU counts as failing
CONFIRM_S = 1.0  # at start: seconds between the samples that confirm a failing clock event


class NotSupported(Exception):
    """NVML cannot answer this query on this GPU (or driver)."""


class GpuLost(Exception):
    """NVML says the GPU is lost (fallen off the bus): failing, whatever was being asked."""


@dataclass(frozen=True, slots=True)
class GpuId:
    uuid: str  # "GPU-…", as NVML spells it
    pci_bus_id: str  # "00000000:3B:00.0", as nvmlPciInfo.busId spells it
    cuda_index: int  # torch's ordinal for it in this process

    def describe(self) -> str:
        return f"{self.uuid} (PCI {self.pci_bus_id}, cuda:{self.cuda_index})"


class Nvml(Protocol):
    """The NVML calls the checks make. Each raises NotSupported where NVML cannot answer, GpuLost for a lost GPU."""

    def handle_by_uuid(self, uuid: str) -> Any: ...
    def handle_by_pci_bus_id(self, pci_bus_id: str) -> Any: ...
    def temperature_c(self, handle: Any) -> int: ...
    def clock_events(self, handle: Any) -> int: ...  # bitmask of nvmlClocksEventReason*
    def ecc_uncorrected(self, handle: Any) -> int: ...  # volatile: since the driver loaded
    def remapped_rows(self, handle: Any) -> tuple[int, int, bool, bool]: ...  # corrected, uncorrected, pending, failed
    def retired_pages_pending(self, handle: Any) -> bool: ...
    def watch_xids(self, handle: Any) -> None: ...  # start collecting XID events of this GPU
    def xids(self, handle: Any) -> list[int]: ...  # the XIDs seen since the last call (does not block)


class PynvmlNvml:
    """`Nvml` through nvidia-ml-py (module `pynvml`), after `nvmlInit`."""

    def __init__(self, lib: Any) -> None:
        self.lib, self._events = lib, None

    def _call(self, fn: Callable, *args: Any) -> Any:
        lib = self.lib
        try:
            return fn(*args)
        except (lib.NVMLError_NotSupported, lib.NVMLError_FunctionNotFound, lib.NVMLError_NoPermission) as e:
            raise NotSupported(str(e)) from e
        except lib.NVMLError_GpuIsLost as e:
            raise GpuLost(str(e)) from e

    def handle_by_uuid(self, uuid: str) -> Any:
        return self._call(self.lib.nvmlDeviceGetHandleByUUID, uuid)

    def handle_by_pci_bus_id(self, pci_bus_id: str) -> Any:
        return self._call(self.lib.nvmlDeviceGetHandleByPciBusId, pci_bus_id)

    def temperature_c(self, handle: Any) -> int:
        return self._call(self.lib.nvmlDeviceGetTemperature, handle, self.lib.NVML_TEMPERATURE_GPU)

    def clock_events(self, handle: Any) -> int:
        lib = self.lib  # "clocks throttle reasons" before nvidia-ml-py 12.535
        fn = (
            getattr(lib, "nvmlDeviceGetCurrentClocksEventReasons", None)
            or lib.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        return self._call(fn, handle)

    def ecc_uncorrected(self, handle: Any) -> int:
        lib = self.lib
        return self._call(
            lib.nvmlDeviceGetTotalEccErrors, handle, lib.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, lib.NVML_VOLATILE_ECC
        )

    def remapped_rows(self, handle: Any) -> tuple[int, int, bool, bool]:
        corr, unc, pending, failed = self._call(self.lib.nvmlDeviceGetRemappedRows, handle)
        return corr, unc, bool(pending), bool(failed)

    def retired_pages_pending(self, handle: Any) -> bool:
        return self._call(self.lib.nvmlDeviceGetRetiredPagesPendingStatus, handle) == self.lib.NVML_FEATURE_ENABLED

    def watch_xids(self, handle: Any) -> None:
        if self._events is None:
            self._events = self._call(self.lib.nvmlEventSetCreate)
        self._call(self.lib.nvmlDeviceRegisterEvents, handle, self.lib.nvmlEventTypeXidCriticalError, self._events)

    def xids(self, handle: Any) -> list[int]:
        if self._events is None:
            raise NotSupported("XID events are not watched")
        out = []
        while True:
            try:
                data = self._call(self.lib.nvmlEventSetWait_v2, self._events, 0)
            except self.lib.NVMLError_Timeout:
                return out
            if data.eventType == self.lib.nvmlEventTypeXidCriticalError:
                out.append(int(data.eventData))


def open_nvml() -> tuple[Nvml | None, str]:
    """NVML through pynvml, or (None, why not)."""
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return None, f"NVML did not start: {e}"
    return PynvmlNvml(pynvml), ""


def cuda_gpu(index: int) -> GpuId:
    """The physical GPU behind torch's `cuda:<index>` in this process (CUDA_VISIBLE_DEVICES applied)."""
    import torch  # only here: nothing else in this file needs torch

    p = torch.cuda.get_device_properties(index)
    uuid = str(p.uuid)
    return GpuId(
        uuid=uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}",
        pci_bus_id=f"{p.pci_domain_id:08X}:{p.pci_bus_id:02X}:{p.pci_device_id:02X}.0",
        cuda_index=index,
    )


def find_handle(nvml: Nvml, gpu: GpuId) -> Any:
    """NVML's handle for `gpu`: by UUID, else by PCI bus id (a MIG instance's UUID names no whole GPU)."""
    try:
        return nvml.handle_by_uuid(gpu.uuid)
    except GpuLost:
        raise
    except Exception:  # noqa: BLE001 - pynvml raises one class per NVML return code; the bus id is the fallback
        return nvml.handle_by_pci_bus_id(gpu.pci_bus_id)


@dataclass(frozen=True, slots=True)
class Sample:
    """One reading of a GPU; None where NVML does not support the query."""

    temperature_c: int | None
    clock_events: int | None
    ecc_uncorrected: int | None
    remapped_rows: tuple[int, int, bool, bool] | None
    retired_pages_pending: bool | None
    xids: tuple[int, ...] | None

    def unsupported(self) -> list[str]:
        return [k for k, v in asdict(self).items() if v is None]


@dataclass(frozen=True, slots=True)
class Finding:
    check: str  # clock_events | temperature | ecc | remapped_rows | retired_pages | xid
    failing: bool
    detail: str


def _maybe(fn: Callable[[Any], Any], handle: Any) -> Any:
    try:
        return fn(handle)
    except NotSupported:
        return None


def read_sample(nvml: Nvml, handle: Any) -> Sample:
    xids = _maybe(nvml.xids, handle)
    return Sample(
        temperature_c=_maybe(nvml.temperature_c, handle),
        clock_events=_maybe(nvml.clock_events, handle),
        ecc_uncorrected=_maybe(nvml.ecc_uncorrected, handle),
        remapped_rows=_maybe(nvml.remapped_rows, handle),
        retired_pages_pending=_maybe(nvml.retired_pages_pending, handle),
        xids=None if xids is None else tuple(xids),
    )


def assess(s: Sample, *, temp_warn_c: float, failing_xids: list[int]) -> list[Finding]:
    """What a sample says, by the table in this module's docstring."""
    out = []
    hot = f" at {s.temperature_c} C" if s.temperature_c is not None else ""
    for bit, (name, failing) in CLOCK_EVENTS.items():
        if (s.clock_events or 0) & bit:
            out.append(Finding("clock_events", failing, f"clock event {name}{hot}"))
    thermal = any(f.failing and "thermal" in f.detail for f in out)
    if s.temperature_c is not None and s.temperature_c >= temp_warn_c and not thermal:
        out.append(Finding("temperature", False, f"{s.temperature_c} C >= failure.health_temp_warn_c({temp_warn_c:g})"))
    if s.ecc_uncorrected:
        out.append(Finding("ecc", True, f"{s.ecc_uncorrected} uncorrected ECC error(s) since the driver loaded"))
    if s.remapped_rows is not None and (s.remapped_rows[2] or s.remapped_rows[3]):
        what = "a row remap failed" if s.remapped_rows[3] else "a row remap is pending (reset the GPU)"
        out.append(
            Finding(
                "remapped_rows",
                True,
                f"{what}; rows remapped: {s.remapped_rows[0]} corrected, {s.remapped_rows[1]} uncorrected",
            )
        )
    if s.retired_pages_pending:
        out.append(Finding("retired_pages", True, "a page retirement is pending (reset the GPU)"))
    for xid in s.xids or ():
        out.append(Finding("xid", xid in failing_xids, f"XID {xid}"))
    return out


class GpuHealth:
    """One rank's GPU checks. `check()` reads and judges once; `start()` runs it every
    `failure.health_every_s` in a thread of its own. Findings go to `emit` as `gpu_health` events
    (the start check always, later ones when they change); a failing one goes to `on_failing` as an
    incident, once. `nvml` None: nothing is checked and `skipped` says why (one event, from rank 0)."""

    def __init__(
        self,
        nvml: Nvml | None,
        *,
        gpu: GpuId | None,
        cfg: FailureConfig,
        rank: int,
        node: str,
        attempt: str,
        emit: Callable[..., Any],
        on_failing: Callable[[Incident], None],
        skipped: str = "",
    ) -> None:
        self.nvml, self.gpu, self.cfg, self.skipped = nvml, gpu, cfg, skipped
        self.rank, self.node, self.attempt, self.emit, self.on_failing = rank, node, attempt, emit, on_failing
        self._handle: Any = None
        self._checks = 0
        self._last: list[tuple] = []
        self._streak: dict[str, int] = {}  # failing clock event -> consecutive samples that showed it
        self._done = threading.Event()

    def check(self) -> list[Finding]:
        """One reading: its findings ([] when healthy or skipped)."""
        self._checks += 1
        if self.nvml is None or self.gpu is None:
            if self._checks == 1 and self.rank == 0:
                self.emit("gpu_health", level="skipped", reason=self.skipped, node=self.node)
                get_logger().info("GPU health: %s", self.skipped)
            return []
        try:
            if self._handle is None:
                self._handle = find_handle(self.nvml, self.gpu)
                _maybe(self.nvml.watch_xids, self._handle)
            sample = read_sample(self.nvml, self._handle)
            found = self._confirm(
                assess(sample, temp_warn_c=self.cfg.health_temp_warn_c, failing_xids=self.cfg.health_failing_xids)
            )
        except GpuLost as e:
            sample, found = None, [Finding("gpu_lost", True, f"NVML: {e} (fallen off the bus?)")]
        key = [(f.check, f.failing, f.detail if f.check == "xid" else "") for f in found]
        if self._checks == 1 or key != self._last:
            self._report(sample, found)
        self._last = key
        if any(f.failing for f in found) and not self._done.is_set():
            self._done.set()  # one incident; the failure path ends the process
            self.on_failing(self.incident(sample, found))
        return found

    def _confirm(self, found: list[Finding]) -> list[Finding]:
        """A failing clock event counts as failing from its CLOCK_EVENT_SAMPLES-th consecutive sample on;
        before that it is a warning saying which sample it is."""

        def event(f: Finding) -> str | None:  # "clock event hw_slowdown at 91 C" -> hw_slowdown
            return f.detail.split()[2] if f.check == "clock_events" and f.failing else None

        seen = {event(f) for f in found} - {None}
        self._streak = {e: self._streak.get(e, 0) + 1 for e in seen}
        out = []
        for f in found:
            n = self._streak[event(f)] if event(f) else CLOCK_EVENT_SAMPLES
            out.append(
                f
                if n >= CLOCK_EVENT_SAMPLES
                else Finding(
                    f.check,
                    False,
                    f"{f.detail} (sample {n} of {CLOCK_EVENT_SAMPLES} in a row before the GPU counts as failing)",
                )
            )
        return out

    def pending(self) -> bool:
        """A failing clock event seen in fewer than CLOCK_EVENT_SAMPLES consecutive samples so far."""
        return any(0 < n < CLOCK_EVENT_SAMPLES for n in self._streak.values())

    def _report(self, sample: Sample | None, found: list[Finding]) -> None:
        level = "failing" if any(f.failing for f in found) else "warning" if found else "ok"
        self.emit(
            "gpu_health",
            level=level,
            gpu=self.gpu.uuid,
            pci_bus_id=self.gpu.pci_bus_id,
            node=self.node,
            findings=[asdict(f) for f in found],
            temperature_c=sample and sample.temperature_c,
            unsupported=sample.unsupported() if sample else [],
        )
        if found:
            get_logger().warning(
                "GPU %s on node %s: %s", self.gpu.describe(), self.node, "; ".join(f.detail for f in found)
            )

    def incident(self, sample: Sample | None, found: list[Finding]) -> Incident:
        """`unhealthy_gpu`: this rank and node the suspects, the GPU named, the sample as evidence."""
        failing = [f for f in found if f.failing]
        suspect = {
            "rank": self.rank,
            "node": self.node,
            "host": os.uname().nodename,
            "pid": os.getpid(),
            "state": "unhealthy_gpu",
            "gpu": self.gpu.uuid,
            "pci_bus_id": self.gpu.pci_bus_id,
            "checks": sorted({f.check for f in failing}),
        }
        return Incident(
            "unhealthy_gpu",
            self.attempt,
            self.rank,
            f"GPU {self.gpu.describe()} of rank {self.rank} on node {self.node}: "
            + "; ".join(f.detail for f in failing),
            [suspect],
            {"sample": sample and asdict(sample), "findings": [asdict(f) for f in found]},
        )

    def start(self) -> GpuHealth:
        """Checks now, in this thread (a failing GPU never joins the rendezvous), then periodically.
        A check that raises (NVML finds no such GPU) turns the checks off, saying why."""
        try:
            self.check()
            while self.pending() and not self._done.wait(CONFIRM_S):  # confirm a clock event before training
                self.check()
        except Exception as e:  # noqa: BLE001 - the checks are an aid; training does not depend on them
            self.nvml, self.skipped = None, f"GPU health check failed: {type(e).__name__}: {e}"
            self.emit("gpu_health", level="skipped", reason=self.skipped, node=self.node)
            get_logger().warning("%s; GPU health is not checked on this rank", self.skipped)
        if self.nvml is not None and self.cfg.health_every_s > 0:
            threading.Thread(target=self._run, name="meshjob-gpu-health", daemon=True).start()
        return self

    def stop(self) -> None:
        """No check reports anything from now on (a finished rank must not start the failure path)."""
        self._done.set()

    def _run(self) -> None:
        while not self._done.wait(self.cfg.health_every_s):
            try:
                self.check()
            except Exception as e:  # noqa: BLE001 - a broken query must not end a healthy rank
                get_logger().warning("GPU health check failed: %s: %s", type(e).__name__, e)


def rank_health(
    device_type: str,
    cuda_index: int | None,
    *,
    cfg: FailureConfig,
    rank: int,
    node: str,
    attempt: str,
    emit: Callable[..., Any],
    on_failing: Callable[[Incident], None],
) -> GpuHealth:
    """This rank's checks: its CUDA device through NVML, or none, saying why ("no GPU: skipped (...)")."""
    nvml, why = open_nvml() if device_type == "cuda" else (None, f"the ranks train on {device_type}")
    gpu = cuda_gpu(cuda_index or 0) if nvml is not None else None
    return GpuHealth(
        nvml,
        gpu=gpu,
        cfg=cfg,
        rank=rank,
        node=node,
        attempt=attempt,
        emit=emit,
        on_failing=on_failing,
        skipped=f"no GPU: skipped ({why})",
    )
