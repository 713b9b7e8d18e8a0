"""Stragglers found two ways, and a whole-job slowdown, in windows of at least WINDOW_STEPS steps, from every
rank's per-phase step times.

- relative: a rank whose phase time exceeds the median of its peers by `failure.straggler_ratio` (and by
  `failure.straggler_min_diff_s`, so microsecond phases never count) for `failure.straggler_intervals`
  consecutive windows. Peers are the ranks of the same pipeline stage (stages differ in work).
  `collective` is not judged: a rank waits there for the others, so the fast
  ranks look slow in it. Their wait can also land inside any other phase that synchronises (FSDP's
  all-gathers in the next microbatch's forward, its reduce-scatters in backward): a rank slowed in
  `backward` makes its peers' `forward` look slow. A peer's wait is at most the straggler's own
  excess, split over the peer's phases, so in each window only the rank with the largest excess
  (seconds over its peers' median) counts; a second, lesser straggler is named once the first is gone.
- individual (NVIDIA Resiliency Extension's individual score): a rank's phase time on `PhaseTimer.own_clock`
  against its own history, the median of its earlier windows not judged slow (once it has HISTORY_WINDOWS),
  scaled by how much its peers grew against theirs (at least 1): same thresholds, same largest-excess rule.
  On a GPU that clock is the host's wall time, which a stopped or descheduled process lengthens while
  the kernel and event clocks do not (and the event clock grows alike on its peers waiting in NCCL).
- slowdown: the median over ranks of a phase against a baseline of the same model, mesh, batch and
  cluster profile, kept from earlier healthy runs (a JSON file under `failure.straggler_baseline_root`:
  per phase the median of the last BASELINE_RUNS runs that finished without a straggler, slowdown or
  failure event), `straggler_ratio` over it for `straggler_intervals` windows: the whole job is slower,
  which no peer comparison can see. A `slowdown` event, naming the phase that grew and every phase's
  ratio, never a straggler: no rank is to blame (on a loaded machine a baseline from a quieter one
  used to fire here as a straggler naming every rank).

All judge windows of at least WINDOW_STEPS steps (several log intervals when `train.log_every` is
shorter; a last, shorter window is not judged), on rank 0 only: the other ranks only send their row in
the step's all-reduce. The first window of an attempt (warm-up) is neither judged nor kept, for the
baseline or for a rank's own history.
The relative check and the slowdown compare `PhaseTimer.clock`'s times: on a GPU the device time of the
compute kernels of one profiled step in every metrics.kernel_every, NCCL's left out
(jobs/telemetry/kernels.py; CUDA event time with kernel_every=0); on a CPU rank `work`, the wall time of
the rank's own work, its CPU time plus the time it was stopped from outside (a rank waiting for its
peers in gloo sleeps and counts neither; see jobs/telemetry/phases.py), which is also its `own_clock`.
Each detection is a `straggler` event (`check` = relative | individual); with
`failure.exclude_stragglers=true` a relative straggler's node goes on the run's quarantine list.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from jobs.telemetry.phases import PhaseTimer

__all__ = [
    "Detection",
    "Slowdown",
    "StragglerDetector",
    "baseline_key",
    "read_baseline",
    "write_baseline",
    "StepTelemetry",
    "NOT_JUDGED",
    "WINDOW_STEPS",
    "peer_medians",
]

NOT_JUDGED = ("collective", "checkpoint")  # a wait for peers; a save is not every step
# A judged window spans at least this many steps, whatever train.log_every is (it ends at the first log
# interval end that completes it). The medians of shorter windows are per-step noise: on 2 CPU ranks a
# step's backward ranged 29-68 ms around 45 ms, and the peer ratio of 4-step medians reached 1.33 in a
# healthy run (16 steps: at most 1.09); with log_every=1, healthy runs named stragglers in 6 of 9 run
# directories, one rank three times at 1.57-1.66x.
WINDOW_STEPS = 20
# The individual check: a rank's own reference is the median of its last HISTORY_MAX windows that were not
# judged slow, once it has HISTORY_WINDOWS of them (the warm-up window is never one).
HISTORY_WINDOWS, HISTORY_MAX = 2, 50
# The relative and individual checks judge each phase and this sum of the judged phases: a rank stopped part
# of the time loses the time in whichever phase a stop lands in, which can change from window to window
# (stops of 300 ms, longer than a step, a few per window), so no one phase stays slow for K windows in a row.
TOTAL = "step"


@dataclass(frozen=True, slots=True)
class Detection:
    """A straggler: one rank slower than its peers (`relative`) or than its own history (`individual`)."""

    check: str  # relative | individual
    phase: str
    ranks: list[int]  # the straggling rank
    ratio: float  # phase time / reference (peers' median, or the rank's own history)
    seconds: float  # the phase's seconds per step in the window
    reference_s: float


@dataclass(frozen=True, slots=True)
class Slowdown:
    """The whole job slower than its stored baseline (every rank's median): no rank is to blame. `phase` is
    the phase that grew (what is known of the cause); `phases` every judged phase's ratio in that window."""

    phase: str
    ratio: float
    seconds: float  # the median over ranks of the phase's seconds per step in the window
    reference_s: float  # the baseline's
    phases: dict[str, float]


@dataclass
class StragglerDetector:
    """Pure: feed it per window one [ranks x phases] matrix of seconds per step on the timer's `clock` (`m`) and,
    for the individual check, one on its `own_clock` (`host`: host time of the rank's own work)."""

    names: tuple[str, ...]
    ratio: float = 1.1
    intervals: int = 3
    min_diff_s: float = 0.005
    baseline: dict[str, float] | None = None
    groups: list[int] | None = None  # per rank: ranks compare only with peers of the same group (pipeline stage)
    _rel: dict[tuple[int, str], int] = field(default_factory=dict)
    _ind: dict[tuple[int, str], int] = field(default_factory=dict)
    _abs: dict[str, int] = field(default_factory=dict)
    _own: list[np.ndarray] = field(default_factory=list)  # host windows, NaN where a rank was judged slow

    @property
    def _cols(self) -> tuple[str, ...]:
        return (*self.names, TOTAL)

    def _with_total(self, m: np.ndarray) -> np.ndarray:
        """`m` and a last column TOTAL: the sum of its judged phases."""
        judged = [j for j, n in enumerate(self.names) if n not in NOT_JUDGED]
        return np.hstack([m, m[:, judged].sum(axis=1, keepdims=True)])

    def observe(self, m: np.ndarray, host: np.ndarray | None = None) -> list[Detection | Slowdown]:
        """Findings that reached `intervals` consecutive windows with this one (each streak once). The checks
        of a rank judge each phase and their sum (TOTAL)."""
        found: list[Detection | Slowdown] = self._relative(self._with_total(m))
        if host is not None:
            found += self._individual(self._with_total(host))
        return found + self._slowdown(m)

    def _slow(self, v: float, ref: float) -> bool:
        return v > ref * self.ratio and v - ref > self.min_diff_s

    def _streaks(self, streaks: dict, slow: dict, check: str) -> list[Detection]:
        """Counts, per (rank, phase), the windows in a row where it was the one rank with the largest excess
        (see the module docstring); a streak that reaches `intervals` is a Detection. TOTAL's only where no
        phase of that rank is in a streak that was named: it is for slowness no one phase holds."""
        top = max(slow, key=lambda k: slow[k][0] - slow[k][1])[0] if slow else None
        out = []
        for key in set(streaks) | set(slow):
            n = streaks.get(key, 0) + 1 if key in slow and key[0] == top else 0
            streaks[key] = n
            if n == self.intervals:
                v, ref = slow[key]
                out.append(Detection(check, key[1], [key[0]], v / ref, v, ref))
        named = {k[0] for k, n in streaks.items() if n >= self.intervals and k[1] != TOTAL}
        out = [d for d in out if d.phase != TOTAL or d.ranks[0] not in named]
        return sorted(out, key=lambda d: (d.ranks, self._cols.index(d.phase)))

    def _hits(self, m: np.ndarray, ref: np.ndarray) -> dict[tuple[int, str], tuple[float, float]]:
        judged = np.array([n not in NOT_JUDGED for n in self._cols])
        with np.errstate(invalid="ignore"):
            hit = (m > ref * self.ratio) & (m - ref > self.min_diff_s) & judged
        return {(int(r), self._cols[j]): (float(m[r, j]), float(ref[r, j])) for r, j in zip(*np.nonzero(hit))}

    def _relative(self, m: np.ndarray) -> list[Detection]:
        """A rank against its peers' median on the timer's clock."""
        return self._streaks(self._rel, self._hits(m, peer_medians(m, self.groups)), "relative")

    def _individual(self, h: np.ndarray) -> list[Detection]:
        """Each rank's phase times on `own_clock` against its own history (NVIDIA Resiliency Extension's
        individual score): the median of its earlier windows (at least HISTORY_WINDOWS) that were not judged
        slow, scaled by how much its peers grew against theirs (at least 1): a machine that slows every rank
        alike, or peers that all wait in their synchronising phases for one stopped rank, grow together and
        name nobody; the rank whose own time grew ratio x more than its peers' did is named."""
        own = np.array(self._own[-HISTORY_MAX:]) if self._own else np.empty((0, *h.shape))
        enough = (np.isfinite(own) & (own > 0)).sum(axis=0) >= HISTORY_WINDOWS
        slow: dict[tuple[int, str], tuple[float, float]] = {}
        if enough.any():
            with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns: not enough history
                ref = np.where(enough, np.nanmedian(own, axis=0), np.nan)
                peers = peer_medians(h / ref, self.groups)  # how much the rest of the group grew
            slow = self._hits(h, ref * np.maximum(peers, 1.0))
        kept = h.astype(float).copy()
        for r, name in slow:  # a slow window does not become the rank's own reference
            kept[r, self._cols.index(name)] = np.nan
        self._own.append(kept)
        return self._streaks(self._ind, slow, "individual")

    def _slowdown(self, m: np.ndarray) -> list[Slowdown]:
        """The median over ranks of each phase against the baseline: the whole job slower, never a straggler."""
        med = {n: float(np.median(m[:, j])) for j, n in enumerate(self.names)}
        base = {n: ref for n, ref in (self.baseline or {}).items() if n in med and n not in NOT_JUDGED and ref}
        out = []
        for name, ref in base.items():
            n = self._abs.get(name, 0) + 1 if self._slow(med[name], ref) else 0
            self._abs[name] = n
            if n == self.intervals:
                ratios = {p: round(med[p] / r, 4) for p, r in base.items()}
                out.append(Slowdown(name, med[name] / ref, med[name], ref, ratios))
        return out


def peer_medians(m: np.ndarray, groups: list[int] | None = None) -> np.ndarray:
    """[ranks x phases]: for each rank and phase, the median of the other ranks of its group (NaN without
    one). Vectorised: per group one sort of each column; leaving out the rank at sorted position p shifts
    the order statistics at and above p by one. O(ranks log ranks) per phase, not O(ranks^2)
    (Python loops took 1.5 s per interval at 2,048 ranks: tests/unit/test_stragglers.py bounds it)."""
    out = np.full(m.shape, np.nan)
    labels = np.zeros(m.shape[0], dtype=int) if groups is None else np.asarray(groups)
    for g in np.unique(labels):
        rows = np.nonzero(labels == g)[0]
        n = len(rows)
        if n < 2:
            continue
        order = np.argsort(m[rows], axis=0, kind="stable")  # [n x phases]
        s = np.take_along_axis(m[rows], order, axis=0)
        pos = np.empty_like(order)
        np.put_along_axis(pos, order, np.arange(n)[:, None], axis=0)  # each rank's sorted position
        lo, hi = (n - 2) // 2, (n - 1) // 2  # the middle of the n - 1 others
        cols = np.arange(m.shape[1])[None, :]
        a = s[lo + (lo >= pos), cols]
        b = s[hi + (hi >= pos), cols]
        out[rows] = (a + b) / 2
    return out


def baseline_key(*, model: str, mesh: str, cluster: str, shape: dict) -> str:
    """The file name of a baseline: model, mesh and cluster profile, plus a hash of everything else
    that sets a step's time (model dims, batch, sequence, device, precision)."""
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:10]
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{model}_{mesh}_{cluster}")
    return f"{safe}_{digest}.json"


def read_baseline(path: Path) -> dict[str, float] | None:
    try:
        return {k: float(v) for k, v in json.loads(path.read_text())["phases_s"].items()}
    except (OSError, ValueError, KeyError):
        return None


BASELINE_RUNS = 5  # healthy runs a baseline keeps; its figure per phase is their median


def write_baseline(path: Path, phases_s: dict[str, float], **about) -> dict[str, float]:
    """Adds a healthy run's phase medians to the baseline at `path` and returns the new baseline: per
    phase, the median of the last BASELINE_RUNS healthy runs (`runs` in the file). One run never
    replaces the figure outright: a run a little slower than the baseline but not judged slow (under
    `straggler_ratio`, or fewer than K intervals) would otherwise become the new reference, and a
    slowdown creeping in a few percent per run would never be caught; a single lucky fast run would
    make every later run look slow. Written atomically (temp file + rename): a reader sees the old
    file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        runs = json.loads(path.read_text()).get("runs", [])
    except (OSError, ValueError, AttributeError):
        runs = []
    runs = [*runs, {"phases_s": phases_s, **about}][-BASELINE_RUNS:]
    names = sorted({n for r in runs for n in r["phases_s"]})
    merged = {n: float(np.median([r["phases_s"][n] for r in runs if n in r["phases_s"]])) for n in names}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"phases_s": merged, **about, "runs": runs}, indent=1))
    os.replace(tmp, path)
    return merged


class StepTelemetry:
    """What the trainer calls: the phase timer, and at each log interval the rank file's flush; at the log
    interval that completes a window of at least `window_steps` steps, one all-reduce of every rank's
    row (its phases on the timer's `clock`, then on its `own_clock`: 2 x phases) and, on rank 0 only, the checks
    and their events; at the end of a healthy run, the baseline. `gather(vector) -> [ranks x 2 phases]` is
    the collective (a seam for tests)."""

    def __init__(
        self,
        timer: PhaseTimer,
        detector: StragglerDetector,
        *,
        rank: int,
        nodes: list[str],
        gather,
        emit,
        baseline_path: Path | None,
        on_straggler=None,
        flush_every_s: float = 0.0,
        window_steps: int = WINDOW_STEPS,
    ) -> None:
        self.timer, self.detector, self.rank, self.nodes = timer, detector, rank, nodes
        self.gather, self.emit, self.baseline_path, self.on_straggler = gather, emit, baseline_path, on_straggler
        self.flush_every_s, self.window_steps = flush_every_s, window_steps
        self._matrix: np.ndarray | None = None  # [ranks x 2 phases] from this window's all-reduce (`incoming`)
        self._window = 0  # steps ended in the window so far (alike on every rank)
        self.history: list[np.ndarray] = []  # rank 0: the medians over ranks of each judged window
        self.found: list[Detection | Slowdown] = []  # rank 0: what the checks found
        self._first = True

    def _window_ends(self, *, interval_end: bool, ended: int) -> bool:
        return interval_end and ended >= self.window_steps

    def outgoing(self, *, interval_end: bool) -> np.ndarray | None:
        """At the last step of a window, before its all-reduce: this rank's window figures (the steps ended
        so far, `_row`) in its row of a zero [ranks x 2 phases] matrix, flattened, to ride in the trainer's one
        all-reduce per step (a separate collective cost 14% of a step on 8 ranks sharing 2 cores).
        None otherwise: every rank decides alike from the step number, so the tensors match."""
        if not self._window_ends(interval_end=interval_end, ended=self._window + 1) or not self.timer.enabled:
            return None
        m = np.zeros((len(self.nodes), 2 * len(self.timer.names)))
        m[self.rank] = self._row()
        return m.ravel()

    def _row(self) -> np.ndarray:
        """The window on the timer's `clock`, then on its `own_clock` (PhaseTimer.take_window)."""
        return self.timer.take_window()

    def incoming(self, flat: np.ndarray) -> None:
        """The all-reduced `outgoing` matrix: every rank's row, judged at `step_done`."""
        self._matrix = flat.reshape(len(self.nodes), 2 * len(self.timer.names))

    def step_done(self, step: int, *, interval_end: bool) -> None:
        self.timer.end_step(step)
        self._window += 1
        if not interval_end or not self.timer.enabled:
            return
        self.timer.flush(min_interval_s=self.flush_every_s)
        if not self._window_ends(interval_end=interval_end, ended=self._window):
            return
        self._window = 0
        m, self._matrix = self._matrix, None
        if m is None:  # nothing rode in a step's all-reduce (a caller without one): a collective of its own
            m = self.gather(self._row())
        if self._first:  # warm-up: lazy init, first collectives
            self._first = False
            return
        if self.rank != 0:  # the checks run once, on rank 0, which reports
            return
        m, host = np.split(m, 2, axis=1)
        self.history.append(np.median(m, axis=0))
        for d in self.detector.observe(m, host):
            self.found.append(d)
            if isinstance(d, Detection):
                self._report(d, step)
            else:
                self._report_slowdown(d, step)

    def _report_slowdown(self, d: Slowdown, step: int) -> None:
        """The whole job slower than its baseline: a `slowdown` event naming no rank."""
        self.emit(
            "slowdown",
            phase=d.phase,
            ratio=round(d.ratio, 4),
            seconds=d.seconds,
            reference_s=d.reference_s,
            phases=d.phases,
            cause=f"{d.phase} grew {d.ratio:.2f}x on the median rank against the baseline "
            f"({1e3 * d.seconds:.1f} ms vs {1e3 * d.reference_s:.1f} ms per step): the whole job, not one rank",
            clock=self.timer.clock,
            baseline=str(self.baseline_path),
            intervals=self.detector.intervals,
            window_steps=self.window_steps,
            step=step,
        )

    def _report(self, d: Detection, step: int) -> None:
        nodes = sorted({self.nodes[r] for r in d.ranks})
        self.emit(
            "straggler",
            check=d.check,
            phase=d.phase,
            ranks=d.ranks,
            nodes=nodes,
            ratio=round(d.ratio, 4),
            seconds=d.seconds,
            reference_s=d.reference_s,
            clock=self.timer.clock if d.check == "relative" else self.timer.own_clock,
            intervals=self.detector.intervals,
            window_steps=self.window_steps,
            step=step,
        )
        if self.on_straggler is not None and d.check == "relative":
            self.on_straggler(nodes, d)

    def finish(self, *, healthy: bool, about: dict) -> bool:
        """Rank 0 writes the baseline when the run was healthy and judged at least one window; returns
        whether it wrote."""
        if self.rank != 0 or not healthy or self.found or not self.history or self.baseline_path is None:
            return False
        med = np.median(np.array(self.history), axis=0)
        phases = {n: float(v) for n, v in zip(self.timer.names, med) if n not in NOT_JUDGED and np.isfinite(v)}
        write_baseline(self.baseline_path, phases, clock=self.timer.clock, intervals=len(self.history), **about)
        return True
