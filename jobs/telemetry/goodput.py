"""Goodput of a run over all its attempts, measured from `events.jsonl` and `metrics.jsonl` alone.

The run's wall time, from the first submit (sacct, when known) or the first attempt's start to the
last attempt's end (or now, for a run still going), is cut into disjoint segments of one kind each:

| kind | what was measured |
|---|---|
| `productive` | a training step whose result the run kept: the last time each step number was trained, by an attempt still running, one that completed, or up to the newest checkpoint committed before the attempt ended otherwise |
| `lost_work` | a step trained again later (after a failure, or discarded by a rollback), or trained after the last committed checkpoint of an attempt that ended without completing (uncommitted: it died with the attempt) |
| `startup` | `attempt_start` to the start of the attempt's first step: rendezvous, build, checkpoint load, warm-up; a whole attempt that never stepped |
| `checkpoint_stall` | `blocking_s` of each `checkpoint_saved`, right after the step it saved |
| `failure_detection` | a failed attempt's last progress (the end of its last step) to its `decision` (or its end) |
| `restart_gap` | between one attempt's end and the next one's start, outside Slurm's queue |
| `queue_wait` | Slurm's Submit to Start of each of the job's records (`sacct --duplicates`), when sacct is available |
| `other` | the rest of an attempt: logging, evaluation, a rollback's reload, the final save, teardown |

Steps are accounted one by one: each `metrics.jsonl` row carries `trained_steps`, [step, end time,
step_time_s] of every step trained since the previous row (a rollback's discarded steps included),
so a save or a pause inside a log interval is a gap between two steps, not part of them. A row
without it (older run dirs) stands for the steps since the attempt's previous row, each taking the
row's step time.

goodput = productive / allocated, where allocated = wall - queue_wait (the time the run held nodes
or was between attempts outside the queue); `wall_goodput` divides by the wall time instead. An
attempt's end is its `attempt_end`; a `lost` attempt's end (written later by the next attempt) is
taken as its own last record; an attempt that died without any end (`close_dead`: Slurm says its job
ended, or its heartbeats went stale) ends at Slurm's End or its last heartbeat / record. An attempt that
ended without completing keeps only the steps up to the newest checkpoint committed (by it or before it):
the steps after it died with it and are `lost_work` at once, not when a requeue trains them again, so a
dead run's goodput does not fall the later one looks. Torch-free: it runs on a login node.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from jobs.failure.ledger import Attempt, attempts

__all__ = [
    "KINDS",
    "Segment",
    "Goodput",
    "Closed",
    "measure_goodput",
    "close_dead",
    "expected_goodput",
    "is_failure",
    "NOT_FAILURES",
]

KINDS = (
    "productive",
    "startup",
    "checkpoint_stall",
    "lost_work",
    "failure_detection",
    "restart_gap",
    "queue_wait",
    "other",
)

# Attempt ends that are not failures of the machine: a finished run, a stop signal, a deliberate stop,
# bad input. The same classes as checkpoint.interval.NOT_FAILURES (a unit test keeps them equal).
NOT_FAILURES = frozenset({"preempted", "walltime", "config_error", "nan_loss", "loss_spike", "non_finite_loss"})
# How an attempt that died without an end ended, by the state Slurm gives its job (else `lost`).
_SLURM_CAUSES = {"COMPLETED": "completed", "TIMEOUT": "walltime", "PREEMPTED": "preempted", "CANCELLED": "cancelled"}


@dataclass(frozen=True, slots=True)
class Segment:
    start: float  # wall-clock seconds (time.time())
    end: float
    kind: str  # one of KINDS
    attempt: str | None = None  # None for restart gaps and queue waits
    step: int | None = None  # the step trained or saved


@dataclass(frozen=True, slots=True)
class Closed:
    """The end given to an attempt that died without writing one."""

    end: float
    cause: str  # lost, or what Slurm's state says (completed, walltime, preempted, cancelled)
    by: str  # what told: "Slurm End (FAILED)", "last heartbeat", "last record"


@dataclass(slots=True)
class Goodput:
    start: float  # first submit or attempt start
    end: float  # last attempt end, or now
    seconds: dict[str, float]  # per kind of KINDS; they sum to wall_s
    attempts_s: float  # time inside attempts
    steps_productive: int
    steps_lost: int
    failures: int  # attempts that ended in a failure (is_failure)
    mtbf_s: float | None  # attempts_s / failures; None without a failure
    mttr_s: float | None  # mean of: a failure's last progress (end of its last step) to the next step's start
    expected: float | None = None  # the goodput expected before submit (expected_goodput), same denominator
    segments: list[Segment] = field(default_factory=list)
    closed: dict[str, Closed] = field(default_factory=dict)  # attempts without attempt_end that close_dead ended

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    @property
    def allocated_s(self) -> float:
        """The wall time less Slurm's queue: the denominator of the headline goodput."""
        return self.wall_s - self.seconds["queue_wait"]

    @property
    def goodput(self) -> float:
        return self.seconds["productive"] / self.allocated_s if self.allocated_s > 0 else 0.0

    @property
    def wall_goodput(self) -> float:
        return self.seconds["productive"] / self.wall_s if self.wall_s > 0 else 0.0


def is_failure(cause: str | None) -> bool:
    """Whether an attempt that ended by `cause` failed (a dead, hung or lost rank...), rather than
    finishing, being stopped by a signal or a user, or stopping on purpose."""
    if cause is None or cause in ("completed", "stop_signal", "cancelled") or cause.startswith("SIG"):
        return False
    return cause not in NOT_FAILURES


def close_dead(
    rows: list[Attempt],
    events: list[dict],
    metrics: list[dict],
    *,
    now: float,
    fresh_s: float,
    beats: dict[str, float] | None = None,
    slurm: dict[str, tuple[str, float | None]] | None = None,
    quiet_s: float = 180.0,
) -> dict[str, Closed]:
    """The attempts without an end that are not running any more, and the end each gets.

    `beats`: each attempt's newest heartbeat time; `slurm`: each attempt's (Slurm state, End) when sacct
    knows its job. An attempt is dead when Slurm's state is an end (closed at End); else, without a
    Slurm answer, when its newest heartbeat is older than `fresh_s` (closed at the later of that beat
    and its last record), or, without heartbeats, when its last record is older than `quiet_s`."""
    beats, slurm, out = beats or {}, slurm or {}, {}
    for a in rows:
        if a.end is not None:
            continue
        last = _last_record(a.attempt, events, metrics, default=a.start)
        state, end = slurm.get(a.attempt, ("", None))
        if state:
            if end is not None and state.split()[0] not in _ACTIVE:
                out[a.attempt] = Closed(
                    max(a.start, end), _SLURM_CAUSES.get(state.split()[0], "lost"), f"Slurm End ({state.split()[0]})"
                )
            continue
        if a.attempt in beats:
            if now - beats[a.attempt] > fresh_s:
                out[a.attempt] = Closed(max(beats[a.attempt], last), "lost", "last heartbeat")
        elif now - last > quiet_s:
            out[a.attempt] = Closed(last, "lost", "last record")
    return out


# Slurm states of a job that may still run (jobs.launch.slurm_state.ACTIVE_STATES; a unit test keeps them equal).
_ACTIVE = frozenset(
    {
        "PENDING",
        "CONFIGURING",
        "RUNNING",
        "COMPLETING",
        "SUSPENDED",
        "STOPPED",
        "SIGNALING",
        "STAGE_OUT",
        "RESIZING",
        "REQUEUED",
        "REQUEUE_HOLD",
        "REQUEUE_FED",
        "SPECIAL_EXIT",
        "RESV_DEL_HOLD",
        "POWER_UP_NODE",
        "UPDATE_DB",
    }
)


def _last_record(attempt: str, events: list[dict], metrics: list[dict], *, default: float) -> float:
    """The time of the attempt's own newest record (not an end or failure written for it by another attempt)."""
    own = [e["time"] for e in events if e.get("attempt") == attempt and e.get("kind") not in ("attempt_end", "failure")]
    own += [m["time"] for m in metrics if m.get("attempt") == attempt and "time" in m]
    return max(own, default=default)


def expected_goodput(
    *, solve_s: float, interval_s: float, blocking_s: float, mtbf_s: float, restart_s: float, startup_s: float
) -> float:
    """Productive over allocated time expected for `solve_s` of training: Daly's expected wall time
    (saves every `interval_s`, each blocking `blocking_s`; failures every `mtbf_s`, each costing
    `restart_s` and the lost work) plus one start-up of `startup_s`."""
    from checkpoint.interval import expected_wall_time

    if solve_s <= 0:
        return 0.0
    wall = expected_wall_time(solve_s, tau=interval_s, delta=blocking_s, mtbf=mtbf_s, restart=restart_s)
    return solve_s / (wall + startup_s)


def measure_goodput(
    events: list[dict],
    metrics: list[dict],
    *,
    now: float,
    queue: list[tuple[float, float]] = (),
    expected: float | None = None,
    closed: dict[str, Closed] | None = None,
) -> Goodput:
    """The goodput of the run whose ledger is `events` and whose step log is `metrics`.

    `now` ends a running attempt; `queue` holds (submit, start) times of the job's Slurm records;
    `closed` the ends of attempts that died without one (close_dead)."""
    closed = closed or {}
    rows = attempts(events)
    for a in rows:
        if a.end is None and a.attempt in closed:
            a.end, a.cause, a.action = closed[a.attempt].end, closed[a.attempt].cause, "none"
    windows = _windows(rows, events, metrics, now=now, closed=closed)
    units = _step_units(rows, metrics)
    segs: list[Segment] = []
    for a in rows:
        start, end = windows[a.attempt]
        mine = [u for u in units if u.attempt == a.attempt] + _stalls(a.attempt, events, units)
        first = min((u.start for u in mine if u.kind in ("productive", "lost_work")), default=end)
        mine.append(Segment(start, max(start, first), "startup", a.attempt))
        mine += _detection(a, events, units, end=end)
        mine.sort(key=lambda s: (s.start, _ORDER[s.kind]))
        segs += _fill(mine, start, end, hole="other", attempt=a.attempt)
    spans = sorted(windows.values())
    t0 = min([spans[0][0]] + [q[0] for q in queue]) if spans else now
    t1 = spans[-1][1] if spans else now
    for i, (lo, hi) in enumerate(zip([t0] + [e for _, e in spans], [s for s, _ in spans] + [t1])):
        segs += _gap(lo, hi, queue, rest="startup" if i == 0 else "restart_gap")
    seconds = {k: 0.0 for k in KINDS}
    for s in segs:
        seconds[s.kind] += s.end - s.start
    failures = [a for a in rows if is_failure(a.cause)]
    inside = sum(e - s for s, e in spans)
    return Goodput(
        start=t0,
        end=t1,
        seconds=seconds,
        attempts_s=inside,
        steps_productive=sum(u.kind == "productive" for u in units),
        steps_lost=sum(u.kind == "lost_work" for u in units),
        failures=len(failures),
        mtbf_s=inside / len(failures) if failures else None,
        mttr_s=_mttr(rows, windows, units),
        expected=expected,
        segments=sorted(segs, key=lambda s: s.start),
        closed={k: v for k, v in closed.items() if k in windows},
    )


# Which of two segments starting at the same time keeps the overlap (_fill: the earlier in this order).
_ORDER = {"productive": 0, "lost_work": 0, "checkpoint_stall": 1, "startup": 2, "failure_detection": 3}


def _detection(a: Attempt, events: list[dict], units: list[Segment], *, end: float) -> list[Segment]:
    """A failed attempt's last progress (the end of its last step) to its decision, else its end."""
    mine = [u.end for u in units if u.attempt == a.attempt]
    if not is_failure(a.cause) or not mine:
        return []
    last = max(mine)
    decided = [
        e["time"] for e in events if e.get("attempt") == a.attempt and e.get("kind") == "decision" and e["time"] >= last
    ]
    return [Segment(last, min(min(decided, default=end), end), "failure_detection", a.attempt)]


def _windows(
    rows: list[Attempt], events: list[dict], metrics: list[dict], *, now: float, closed: dict[str, Closed]
) -> dict[str, tuple[float, float]]:
    """Each attempt's (start, end), made disjoint: an attempt ends at the latest when the next begins."""
    out = {}
    for i, a in enumerate(rows):
        if a.attempt in closed:
            end = closed[a.attempt].end
        elif a.cause == "lost":  # its end was written by the next attempt: its own last record
            end = _last_record(a.attempt, events, metrics, default=a.start)
        else:
            end = a.end if a.end is not None else now
        if i + 1 < len(rows):
            end = min(end, rows[i + 1].start)
        out[a.attempt] = (a.start, max(a.start, end))
    return out


def _step_units(rows: list[Attempt], metrics: list[dict]) -> list[Segment]:
    """One segment per trained step, `productive` for the last training of its step number when its attempt kept
    it (`_committed`), else `lost_work` (trained again after a failure or a rollback, or never committed)."""
    known = {a.attempt: a for a in rows}
    prev: dict[str, int] = {}
    trained: list[tuple[int, Segment]] = []
    for m in metrics:
        a = known.get(m.get("attempt"))
        if a is None or "time" not in m or m.get("record") == "eval":  # an evaluation line trains no step
            continue
        step = int(m["step"])
        if "trained_steps" in m:  # [step, end time, step_time_s] of each step since the previous row
            trained += [
                (int(j), Segment(t - dt, t, "productive", a.attempt, int(j))) for j, t, dt in m["trained_steps"]
            ]
        else:  # an older row: it stands for the steps since the attempt's previous row (only itself after a rollback)
            dt = float(m.get("step_time_s") or 0.0)
            lo = prev.get(a.attempt, a.start_step if a.start_step is not None else step - 1)
            for j in range(lo + 1 if lo < step else step, step + 1):
                end = m["time"] - (step - j) * dt
                trained.append((j, Segment(end - dt, end, "productive", a.attempt, j)))
        prev[a.attempt] = step
    last = {j: i for i, (j, _) in enumerate(trained)}
    kept = _committed(rows)
    return [
        s if last[j] == i and j <= kept[s.attempt] else Segment(s.start, s.end, "lost_work", s.attempt, j)
        for i, (j, s) in enumerate(trained)
    ]


def _committed(rows: list[Attempt]) -> dict[str, float]:
    """The newest step each attempt's work is kept up to: every step while it runs or when it completed, else
    the newest checkpoint committed by it or an earlier attempt (steps past it died with the attempt)."""
    out, saved = {}, -1
    for a in rows:
        saved = max(saved, a.saved_step if a.saved_step is not None else -1)
        out[a.attempt] = float("inf") if a.end is None or a.cause == "completed" else saved
    return out


def _stalls(attempt: str, events: list[dict], units: list[Segment]) -> list[Segment]:
    """The blocking part of each save, placed right after the step it saved (else before its event)."""
    ends = {u.step: u.end for u in units if u.attempt == attempt}
    out = []
    for e in events:
        if e.get("kind") == "checkpoint_saved" and e.get("attempt") == attempt:
            start = ends.get(e.get("step"), e["time"] - float(e.get("total_s") or 0.0))
            out.append(
                Segment(start, start + float(e.get("blocking_s") or 0.0), "checkpoint_stall", attempt, e.get("step"))
            )
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
    waits = sorted(
        (Segment(max(s, lo), min(e, hi), "queue_wait") for s, e in queue if min(e, hi) > max(s, lo)),
        key=lambda s: s.start,
    )
    return [s for s in _fill(waits, lo, hi, hole=rest, attempt=None) if s.end > s.start]


def _mttr(rows: list[Attempt], windows: dict[str, tuple[float, float]], units: list[Segment]) -> float | None:
    """Mean time from a failure's last progress (the end of the newest step trained up to it, else its
    attempt's start) to the start of the next step trained after it."""
    order = {a.attempt: i for i, a in enumerate(rows)}
    repairs = []
    for i, a in enumerate(rows):
        if not is_failure(a.cause):
            continue
        later = [u.start for u in units if order[u.attempt] > i]
        progress = max((u.end for u in units if order[u.attempt] <= i), default=windows[a.attempt][0])
        if later:
            repairs.append(min(later) - progress)
    return statistics.fmean(repairs) if repairs else None
