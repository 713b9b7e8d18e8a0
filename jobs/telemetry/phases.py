"""Per-rank phase timing: seconds per step in data, forward, backward (or pp_step), collective, optimizer
and checkpoint, appended by each rank to its own `RUN_DIR/telemetry/rank<r>.h5`.

The file (read by `jobs.telemetry.run_report.read_phases`): one chunked, resizable 1-D float64 dataset
per phase (seconds in that phase during the step; 0 when the step had none, e.g. `checkpoint`), and
`step` (int), `attempt` (int, an index into the file attribute `attempts`, a JSON list of attempt
names: a restarted attempt appends rows with its own index) and `time` (epoch seconds at step end);
on a CPU rank, the 2-D dataset `cpu` (rows x phases, its attribute `phases` names the columns) holds
the same phases in CPU seconds (the straggler checks judge those plus the seconds the rank was
stopped in the phase: `Descheduled`).

Writing: rows are buffered in memory and appended every `train.log_every` steps by opening the file,
resizing, writing and closing it again. Measured on h5py 3 / HDF5 1.14 (tests/unit/test_stragglers.py
keeps it true): a file closed between flushes is readable by anyone at any time and intact after a
kill -9 (even one during a flush keeps the last completed flush). SWMR (`libver="latest"` +
`swmr_mode`) was tried and rejected: after a kill -9 the file refuses every non-SWMR reader and any
writer ("file is already open for write, use h5clear"), so a restarted attempt could not append.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: jobs.status reads the ledger through run_report, which imports this file
    import numpy as np

    from jobs.telemetry.kernels import KernelSampler

__all__ = [
    "PHASES",
    "PhaseTimer",
    "Descheduled",
    "SlowPhase",
    "SLOW_PHASE_VAR",
    "slow_phase_from_env",
    "phase_names",
    "in_step_order",
    "META",
    "committed_rows",
]

PHASES = ("data", "forward", "backward", "pp_step", "collective", "optimizer", "checkpoint")
META = ("step", "attempt", "time", "cpu")  # datasets of the file that are not phases

# TEST-ONLY fault injection (like tests/chaos): "<rank|all>:<phase>:<factor>" makes the phase timer spin
# (burn CPU, as a slower chip would compute longer) for (factor - 1) x the phase's measured CPU time at
# the end of that phase, so the phase costs factor x as much: a slow chip, which cannot come from outside
# (a rank stopped from outside is counted apart as descheduled, see Descheduled). CPU ranks only.
# Read once when the timer is built; never set it in a real run.
SLOW_PHASE_VAR = "MESHJOB_TEST_SLOW_PHASE"


class Descheduled:
    """Seconds this process has spent stopped (SIGSTOP/SIGCONT from outside, cpulimit's duty cycle, a
    debugger): a small watcher process (started once per rank, `get`) reads the rank's state in
    /proc/<pid>/stat every PERIOD_S and adds the time between samples that find it stopped (T) to a
    double in shared memory, which `seconds` reads (about a microsecond). From outside, because a stop
    freezes every thread of the rank: a thread inside sees only a gap, and on a loaded machine a gap is
    just as often a core it waited for or a GIL another thread held (tried: up to 30% of a busy
    phase counted so). A rank asleep in a gloo collective, waiting for a slower peer, is not stopped: its
    wait counts nothing, and a healthy rank's count stays exactly 0. Run-queue waits of a busy machine
    are left out on purpose: on the shared 2-core CI box they are the noise that made healthy runs'
    wall times vary 2x. The watcher exits when the rank does.
    """

    PERIOD_S = 0.005
    _one: Descheduled | None = None
    _pid = 0

    def __init__(self) -> None:
        import mmap
        import subprocess
        import sys
        import tempfile

        fd, path = tempfile.mkstemp(prefix="meshjob-stopped-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        os.unlink(path)  # the watcher gets the open file itself (pass_fds): nothing is left behind
        os.write(fd, bytes(8))
        self._map = mmap.mmap(fd, 8)
        self._watcher = subprocess.Popen(
            [sys.executable, "-c", _WATCHER, str(os.getpid()), str(fd), str(self.PERIOD_S)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(fd,),
            start_new_session=True,
        )  # no pipe of the rank's held open
        os.close(fd)

    @property
    def seconds(self) -> float:
        return struct.unpack_from("d", self._map)[0]

    @classmethod
    def get(cls) -> Descheduled:
        if cls._one is None or cls._pid != os.getpid():  # a forked child needs a watcher of its own
            cls._one, cls._pid = cls(), os.getpid()
        return cls._one


# The watcher (python -c, so that it imports nothing of the rank's): argv pid, the shared file's fd, period.
_WATCHER = """
import mmap, os, struct, sys, time
pid, fd, period = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
m = mmap.mmap(fd, 8)
os.close(fd)
stopped, last = 0.0, time.monotonic()
while True:
    time.sleep(period)
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        break
    now = time.monotonic()
    if state in (b"T", b"t"):
        stopped += now - last
        struct.pack_into("d", m, 0, stopped)
    elif state in (b"Z", b"X"):
        break
    last = now
"""


@dataclass(frozen=True, slots=True)
class SlowPhase:
    """The test-only slowdown of one phase on one rank (or all ranks)."""

    rank: int | None  # None = every rank
    phase: str
    factor: float


def slow_phase_from_env(rank: int, environ: dict[str, str] | None = None) -> SlowPhase | None:
    """The MESHJOB_TEST_SLOW_PHASE slowdown that applies to `rank`, or None."""
    spec = (os.environ if environ is None else environ).get(SLOW_PHASE_VAR, "")
    if not spec:
        return None
    who, phase, factor = spec.split(":")
    if phase not in PHASES:
        raise ValueError(f"{SLOW_PHASE_VAR}={spec!r}: phase {phase!r} is not one of {', '.join(PHASES)}")
    target = None if who == "all" else int(who)
    if target not in (None, rank):
        return None
    return SlowPhase(target, phase, float(factor))


def in_step_order(phases: dict[int, dict[str, float]]) -> list[str]:
    """The phase names found in `phases` (rank -> phase -> seconds), in PHASES order, then others by name."""
    names = sorted({n for p in phases.values() for n in p})
    return sorted(names, key=lambda n: (PHASES.index(n) if n in PHASES else len(PHASES), n))


def phase_names(*, pp: bool) -> tuple[str, ...]:
    """The phases a step has: the pipeline schedule's step is one phase (its forward and backward interleave)."""
    return tuple(p for p in PHASES if (p == "pp_step") == pp or p not in ("forward", "backward", "pp_step"))


class PhaseTimer:
    """Times the phases of each step on this rank; `with timer.phase("forward"): ...` adds to the step's row.

    On CPU a phase is `time.perf_counter()` around it (the work is done when the call returns): that
    wall time goes to the file. The straggler checks get the wall time of the rank's own work instead
    (clock `work`): the phase's CPU time (`process_time`, all of the rank's threads) plus the time the
    process was stopped from outside in it (`Descheduled`). A rank waiting in a gloo collective sleeps, so its
    wait for a slower peer counts neither way and does not make it look slow (its wall time would: on
    the loaded 2-core CI machine the wall time of one phase varied 2x between intervals of a healthy
    run, tests/multiproc/test_stragglers.py); a rank stopped or throttled from outside part of the
    time, invisible to CPU time alone, is as slow as its peers find it. On CUDA
    the kernels are only queued when the call returns, so a host clock would time the launch, not the
    work, and a `torch.cuda.synchronize()` per phase would stall the queue (and cost more than the 3%
    budget). Instead a pair of CUDA events is recorded on the current stream around each phase and read
    (`elapsed_time`, after `synchronize()` on its end event) only at the log interval, when the rows are
    flushed and judged: by then the stream has long passed those events (the trainer's loss/grad-norm
    all-reduce waits for the stream with `float()` every step), so reading them adds no stall. An
    event pair measures stream time between the two points: the phase's kernels, plus any gap where
    the stream waited for the host or another stream (an NCCL wait shows up where it happens). Those
    rows go to the file. A slow rank's peers wait for it in NCCL, so their event times grow with its
    excess: with `kernels` (metrics.kernel_every > 0; opt-in until run on a GPU) the straggler checks judge instead
    one step in every kernel_every by the device time of its compute kernels, NCCL's left out
    (jobs/telemetry/kernels.py); the profiled step pays the profiler and one device synchronize.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        rank: int,
        attempt: str,
        pp: bool,
        device_type: str = "cpu",
        enabled: bool = True,
        slow: SlowPhase | None = None,
        kernels: KernelSampler | None = None,
        events: type | None = None,
    ) -> None:
        """`events`: the CUDA event type, torch.cuda.Event unless given: the one seam through which a test runs
        a CUDA rank's clocks (event time for the peer check, host time for the individual one) on a CPU."""
        self.path = Path(run_dir) / "telemetry" / f"rank{rank}.h5"
        self.attempt, self.enabled, self.slow = attempt, enabled, slow
        self.names = phase_names(pp=pp)
        self.cuda = device_type == "cuda"
        self._kernels = kernels if self.cuda and enabled else None  # metrics.kernel_every: what stragglers judge
        self._steps = 0  # steps ended by this timer (the sampler profiles every kernel_every-th, the first included)
        self._row: dict[str, float] = dict.fromkeys(self.names, 0.0)
        self._cpu: dict[str, float] = dict.fromkeys(self.names, 0.0)  # CPU seconds (CPU ranks)
        self._desched: dict[str, float] = dict.fromkeys(
            self.names, 0.0
        )  # seconds descheduled (CPU ranks): judged with _cpu
        self._events: list[tuple[str, object, object]] = []  # this step's CUDA (phase, start, end)
        self._pending: list[tuple[list[float], list[tuple[str, object, object]]]] = []  # rows whose events are unread
        self._rows: list[
            tuple[int, float, list[float], list[float]]
        ] = []  # (step, time, wall s, CPU s) not yet written
        self.interval: list[list[float]] = []  # this window's rows: CPU seconds, event or kernel time (stragglers)
        self.own_interval: list[list[float]] = []  # this window's rows: seconds stopped (CPU), host wall s (CUDA)
        self._host: dict[str, float] = dict.fromkeys(self.names, 0.0)  # host wall seconds (CUDA ranks)
        self._event = events
        self._flushed_at = -float("inf")  # time.monotonic() of the last flush
        self._off = Descheduled.get() if enabled and not self.cuda else None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        assert name in self._row, (name, self.names)
        if self.cuda:
            import torch

            k = self._kernels
            if k is not None and not k.active and self._steps % k.every == 0 and not self._events:
                k.begin()  # this step's first phase: the step is profiled
            event = self._event or torch.cuda.Event
            start, end = event(enable_timing=True), event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            with k.range(name) if k is not None else contextlib.nullcontext():
                yield
            end.record()
            self._host[name] += time.perf_counter() - t0
            self._events.append((name, start, end))
            return
        t0, c0, d0 = time.perf_counter(), time.process_time(), self._off.seconds
        yield
        if self.slow is not None and self.slow.phase == name:  # test-only (MESHJOB_TEST_SLOW_PHASE)
            until = time.process_time() + (self.slow.factor - 1.0) * (time.process_time() - c0)
            while time.process_time() < until:
                pass
        self._row[name] += time.perf_counter() - t0
        self._cpu[name] += time.process_time() - c0
        self._desched[name] += self._off.seconds - d0

    def end_step(self, step: int) -> None:
        """Closes the step's row (phases it did not enter stay 0)."""
        if not self.enabled:
            return
        row, cpu = [self._row[n] for n in self.names], [self._cpu[n] for n in self.names]
        if self._events:
            self._pending.append((row, self._events))
            self._events = []
        self._rows.append((step, time.time(), row, cpu))
        if not self.cuda:
            self.interval.append(cpu)
            self.own_interval.append([self._desched[n] for n in self.names])
        else:
            self.own_interval.append([self._host[n] for n in self.names])
        if self.cuda and self._kernels is None:
            self.interval.append(row)
        elif self.cuda and self._kernels.active:  # a profiled step: its compute kernels' device time
            self.interval.append(self._kernels.end(self.names))
        self._steps += 1
        self._row, self._cpu, self._desched, self._host = (dict.fromkeys(self.names, 0.0) for _ in range(4))

    def drop_step(self) -> None:
        """Forgets the open step's row (a step rolled back by the training-health check is not a step)."""
        self._row, self._cpu, self._desched, self._host = (dict.fromkeys(self.names, 0.0) for _ in range(4))
        self._events = []
        if self._kernels is not None:
            self._kernels.cancel()

    @property
    def clock(self) -> str:
        """What the straggler checks compare: on a GPU the compute kernels' device time of the profiled steps
        (`kernels`, metrics.kernel_every) or CUDA event time (`cuda`, kernel_every=0); on a CPU rank `work` (CPU
        time plus time descheduled)."""
        if self.cuda:
            return "cuda" if self._kernels is None else "kernels"
        return "work"

    def _read_events(self) -> None:
        """Adds the CUDA events' times to their rows (the rows are shared with `interval`)."""
        for row, events in self._pending:
            for name, start, end in events:
                end.synchronize()
                row[self.names.index(name)] += start.elapsed_time(end) / 1e3
        self._pending.clear()

    def take_interval(self) -> np.ndarray:
        """Seconds per step of each phase on `clock` over the steps since the last call (NaN when none)."""
        return self.take_window()[: len(self.names)]

    def take_window(self) -> np.ndarray:
        """The window since the last call, per phase (NaN when it has no step): first on `clock` (what the peer
        check compares), then on `own_clock` (what the individual check compares with the rank's own history).

        On a CPU rank both are `work`: the median CPU seconds per step plus the mean seconds stopped per step (0
        on a healthy rank). A mean, not a median, of the stops: a rank stopped a third of the time in stops
        longer than a step loses whole steps here and there, which a median per phase never sees. On a CUDA
        rank the median event (or profiled kernel) time, then the mean host wall seconds per step."""
        import numpy as np  # lazy: a rank's method (see TYPE_CHECKING above)

        self._read_events()
        rows, own, self.interval, self.own_interval = self.interval, self.own_interval, [], []
        nan = np.full(len(self.names), np.nan)
        clock = np.median(np.array(rows), axis=0) if rows else nan
        extra = np.mean(np.array(own), axis=0) if own else nan
        if not self.cuda:
            clock = clock + extra
            return np.concatenate([clock, clock])
        return np.concatenate([clock, extra])

    @property
    def own_clock(self) -> str:
        """What the individual check compares: the host time of the rank's own work in each phase. On a GPU the
        host wall time around the phase (`host`): a host stall (a stopped or descheduled process) lengthens it
        while the kernel and event clocks do not (the device just waits), and a peer waiting in NCCL waits on
        the device, not on its host. On a CPU rank `work`, as for `clock`: there a peer waits for a stopped rank
        asleep in gloo on its host, so its host wall time grows as much as the stopped rank's (in a 4-rank run
        with one rank stopped 30% of the time the host-time scores did not single it out), and on a shared
        box a phase's wall time varied 2x between windows of a healthy run."""
        return "host" if self.cuda else "work"

    def flush(self, *, min_interval_s: float = 0.0) -> None:
        """Appends the buffered rows to this rank's file (open, append, close: see the module docstring);
        with `min_interval_s`, only when that long has passed since the last flush (one costs 4-6 ms of CPU)."""
        if not self.enabled or not self._rows:
            return
        if min_interval_s > 0 and time.monotonic() - self._flushed_at < min_interval_s:
            return
        self._flushed_at = time.monotonic()
        import h5py

        self._read_events()
        rows, self._rows = self._rows, []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with h5py.File(self.path, "a") as f:
            attempts = json.loads(f.attrs.get("attempts", "[]"))
            if self.attempt not in attempts:
                attempts.append(self.attempt)
                f.attrs["attempts"] = json.dumps(attempts)
            cols = {
                "step": [r[0] for r in rows],
                "time": [r[1] for r in rows],
                "attempt": [attempts.index(self.attempt)] * len(rows),
            }
            cols.update({n: [r[2][i] for r in rows] for i, n in enumerate(self.names)})
            if not self.cuda and ("cpu" not in f or json.loads(f["cpu"].attrs["phases"]) == list(self.names)):
                cols["cpu"] = [r[3] for r in rows]  # (another mesh's columns: left NaN for this attempt)
            _append(f, cols)
            if "cpu" in cols and "phases" not in f["cpu"].attrs:
                f["cpu"].attrs["phases"] = json.dumps(self.names)


def committed_rows(f) -> int:
    """Rows of an open rank file that every dataset holds in full, even when it is read during a
    flush: `_append` writes `step` last, so the rows whose `step` is written (not the -1 fill of a
    resize in progress) are complete in every other dataset."""
    if "step" not in f:
        return 0
    step = f["step"][()]
    n = len(step)
    while n and step[n - 1] == -1:
        n -= 1
    return n


def _append(f, cols: dict[str, list]) -> None:
    """Appends equal-length columns (`cpu` is 2-D: rows x phases); a dataset this attempt does not
    write (a phase of another mesh) is padded with NaN, and a new one starts with NaN for the rows before
    it. `step` goes last (`committed_rows`): a reader during the flush sees datasets of different lengths."""
    import numpy as np  # lazy: a rank's flush (see TYPE_CHECKING above)

    have = {name: f[name] for name in f}  # each dataset looked up once (h5py's lookups are the cost)
    old = have["step"].shape[0] if "step" in have else 0
    n = len(cols["step"])
    for name in sorted(have.keys() | cols.keys(), key=lambda k: k == "step"):
        ds = have.get(name)
        if ds is None:
            dtype = "i8" if name in ("step", "attempt") else "f8"
            width = (len(cols[name][0]),) if name == "cpu" else ()
            ds = f.create_dataset(
                name,
                shape=(old, *width),
                maxshape=(None, *width),
                chunks=(1024, *width),
                dtype=dtype,
                fillvalue=-1 if dtype == "i8" else np.nan,
            )
        ds.resize(old + n, axis=0)
        ds[old:] = cols[name] if name in cols else np.nan
