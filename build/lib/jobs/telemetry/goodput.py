"""Goodput of a run over all its attempts, measured from `events.jsonl` and `metrics.jsonl` alone.

The run's wall time, from the first submit (sacct, when known) or the first attempt's start to the
last attempt's end (or now, for a run still going), is cut into disjoint segments of one kind each:

| kind | what was measured |
|---|---|
| `productive` | a training step whose result the run kept: the last time each step number was trained (`step_time_s` of `metrics.jsonl`) |
| `lost_work` | a step trained again later, because the attempt that trained it ended after its last checkpoint |
| `startup` | `attempt_start` to the start of the attempt's first step: rendezvous, build, checkpoint load, warm-up; a whole attempt that never stepped |
| `checkpoint_stall` | `blocking_s` of each `checkpoint_saved`: what training waited for per save |
| `restart_gap` | between one attempt's end and the next one's start, outside Slurm's queue |
| `queue_wait` | Slurm's Submit to Start of each of the job's records (`sacct --duplicates`), when sacct is available |
| `other` | the rest of an attempt: logging, time after its last step (failure detection, the final save, teardown) |

goodput = productive / wall. A step logged every `train.log_every` steps stands for the steps since
the previous logged one, each taking the logged step's time. An attempt's end is its `attempt_end`;
a `lost` attempt's end (written later by the next attempt) is taken as its own last record instead.
Torch-free: it runs on a login node.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from jobs.failure.ledger import Attempt, attempts

__all__ = ["KINDS", "Segment", "Goodput", "measure_goodput", "is_failure"]

KINDS = ("productive", "startup", "checkpoint_stall", "lost_work", "restart_gap", "queue_wait", "other")

# Attempt ends that are not failures of the machine: a finished run, a stop signal, a deliberate stop,
# bad input. The same classes as checkpoint.interval._NOT_FAILURES (a unit test keeps them equal).
_NOT_FAILURES = frozenset({"preempted", "walltime", "config_error", "nan_loss", "loss_spike", "non_finite_loss"})


@dataclass(frozen=True, slots=True)
class Segment:
    start: float  # wall-clock seconds (time.time())
    end: float
    kind: str  # one of KINDS
    attempt: str | None = None  # None for restart gaps and queue waits
    step: int | None = None  # the step trained or saved


@dataclass(slots=True)
class Goodput:
    start: float  # first submit or attempt start
    end: float  # last attempt end, or now
    seconds: dict[str, float]  # per kind of KINDS; they sum to wall_s
    allocated_s: float  # time inside attempts (the job held its nodes)
    steps_productive: int
    steps_lost: int
    failures: int  # attempts that ended in a failure (is_failure)
    mtbf_s: float | None  # allocated_s / failures; None without a failure
    mttr_s: float | None  # mean of: a failed attempt's end to the next first step's start
    expected: float | None = None  # the goodput jobs.plan expected before submit
    segments: list[Segment] = field(default_factory=list)

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    @property
    def goodput(self) -> float:
        return self.seconds["productive"] / self.wall_s if self.wall_s > 0 else 0.0


def is_failure(cause: str | None) -> bool:
    """Whether an attempt that ended by `cause` failed (a dead, hung or lost rank...), rather than
    finishing, being stopped by a signal, or stopping on purpose."""
    if cause is None or cause in ("completed", "stop_signal") or cause.startswith("SIG"):
        return False
    return cause not in _NOT_FAILURES


def measure_goodput(events: list[dict], metrics: list[dict], *, now: float,
                    queue: list[tuple[float, float]] = (), expected: float | None = None) -> Goodput:
    """The goodput of the run whose ledger is `events` and whose step log is `metrics`.

    `now` ends a running attempt; `queue` holds (submit, start) times of the job's Slurm records."""
    rows = attempts(events)
    windows = _windows(rows, events, metrics, now=now)
    units = _step_units(rows, metrics)
    segs: list[Segment] = []
    for a in rows:
        start, end = windows[a.attempt]
        mine = [u for u in units if u.attempt == a.attempt] + _stalls(a.attempt, events, units)
        first = min((u.start for u in mine if u.kind in ("productive", "lost_work")), default=end)
        mine.append(Segment(start, max(start, first), "startup", a.attempt))
        segs += _fill(sorted(mine, key=lambda s: s.start), start, end, hole="other", attempt=a.attempt)
    spans = sorted(windows.values())
    t0 = min([spans[0][0]] + [q[0] for q in queue]) if spans else now
    t1 = spans[-1][1] if spans else now
    for i, (lo, hi) in enumerate(zip([t0] + [e for _, e in spans], [s for s, _ in spans] + [t1])):
        segs += _gap(lo, hi, queue, rest="startup" if i == 0 else "restart_gap")
    seconds = {k: 0.0 for k in KINDS}
    for s in segs:
        seconds[s.kind] += s.end - s.start
    failures = [a for a in rows if is_failure(a.cause)]
    allocated = sum(e - s for s, e in spans)
    return Goodput(
        start=t0, end=t1, seconds=seconds, allocated_s=allocated,
        steps_productive=sum(u.kind == "productive" for u in units), steps_lost=sum(u.kind == "lost_work" for u in units),
        failures=len(failures), mtbf_s=allocated / len(failures) if failures else None,
        mttr_s=_mttr(rows, windows, units), expected=expected,
        segments=sorted(segs, key=lambda s: s.start),
    )


def _windows(rows: list[Attempt], events: list[dict], metrics: list[dict], *, now: float) -> dict[str, tuple[float, float]]:
    """Each attempt's (start, end), made disjoint: an attempt ends at the latest when the next begins."""
    out = {}
    for i, a in enumerate(rows):
        end = a.end if a.end is not None and a.cause != "lost" else None
        if end is None and a.cause == "lost":  # its end was written by the next attempt: its own last record
            own = [e["time"] for e in events if e.get("attempt") == a.attempt and e.get("kind") not in ("attempt_end", "failure")]
            own += [m["time"] for m in metrics if m.get("attempt") == a.attempt and "time" in m]
            end = max(own, default=a.start)
        if end is None:
            end = now
        if i + 1 < len(rows):
            end = min(end, rows[i + 1].start)
        out[a.attempt] = (a.start, max(a.start, end))
    return out


def _step_units(rows: list[Attempt], metrics: list[dict]) -> list[Segment]:
    """One segment per trained step, `productive` for the last training of its step number, else
    `lost_work`. A logged row stands for the steps since the attempt's previous row."""
    known = {a.attempt: a for a in rows}
    prev: dict[str, int] = {}
    trained: list[tuple[int, Segment]] = []
    for m in metrics:
        a = known.get(m.get("attempt"))
        if a is None or "time" not in m or m.get("record") == "eval":  # an evaluation line trains no step
            continue
        step, dt = int(m["step"]), float(m.get("step_time_s") or 0.0)
        lo = prev.get(a.attempt, a.start_step if a.start_step is not None else step - 1)
        for j in range(lo + 1, step + 1):
            end = m["time"] - (step - j) * dt
            trained.append((j, Segment(end - dt, end, "productive", a.attempt, j)))
        prev[a.attempt] = step
    last = {j: i for i, (j, _) in enumerate(trained)}
    return [s if last[j] == i else Segment(s.start, s.end, "lost_work", s.attempt, j) for i, (j, s) in enumerate(trained)]


def _stalls(attempt: str, events: list[dict], units: list[Segment]) -> list[Segment]:
    """The blocking part of each save, placed right after the step it saved (else before its event)."""
    ends = {u.step: u.end for u in units if u.attempt == attempt}
    out = []
    for e in events:
        if e.get("kind") == "checkpoint_saved" and e.get("attempt") == attempt:
            start = ends.get(e.get("step"), e["time"] - float(e.get("total_s") or 0.0))
            out.append(Segment(start, start + float(e.get("blocking_s") or 0.0), "checkpoint_stall", attempt, e.get("step")))
    return out


def _fill(segs: list[Segment], start: float, end: float, *, hole: str, attempt: str | None) -> list[Segment]:
    """`segs` (sorted by start) clipped to [start, end] and to each other (the earlier one keeps an
    overlap), with every hole between them filled by a segment of kind `hole`."""
    out, cursor = [], start
    for s in segs:
        lo, hi = max(s.start, cursor), min(s.end, end)
        if lo >= end:
            break
        if lo > cursor:
            out.append(Segment(cursor, lo, hole, attempt))
            cursor = lo
        if hi > lo:
            out.append(Segment(lo, hi, s.kind, s.attempt, s.step))
            cursor = hi
    if end > cursor:
        out.append(Segment(cursor, end, hole, attempt))
    return out


def _gap(lo: float, hi: float, queue: list[tuple[float, float]], *, rest: str) -> list[Segment]:
    """[lo, hi] outside every attempt: Slurm's queue where sacct says the job waited, `rest` elsewhere."""
    waits = sorted((Segment(max(s, lo), min(e, hi), "queue_wait") for s, e in queue if min(e, hi) > max(s, lo)),
                   key=lambda s: s.start)
    return [s for s in _fill(waits, lo, hi, hole=rest, attempt=None) if s.end > s.start]


def _mttr(rows: list[Attempt], windows: dict[str, tuple[float, float]], units: list[Segment]) -> float | None:
    """Mean time from a failed attempt's end to the start of the next step trained after it."""
    order = {a.attempt: i for i, a in enumerate(rows)}
    repairs = []
    for i, a in enumerate(rows):
        if not is_failure(a.cause):
            continue
        later = [u.start for u in units if order[u.attempt] > i]
        if later:
            repairs.append(min(later) - windows[a.attempt][1])
    return statistics.fmean(repairs) if repairs else None
