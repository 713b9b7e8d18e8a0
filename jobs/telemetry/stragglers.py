"""Stragglers found two ways in windows of at least WINDOW_STEPS steps, from every rank's per-phase step times.

- relative: a rank whose phase time exceeds the median of its peers by `failure.straggler_ratio` (and by
  `failure.straggler_min_diff_s`, so microsecond phases never count) for `failure.straggler_intervals`
  consecutive windows. Peers are the ranks of the same pipeline stage (stages differ in work).
  `collective` is not judged: a rank waits there for the others, so the fast
  ranks look slow in it. Their wait can also land inside any other phase that synchronises (FSDP's
  all-gathers in the next microbatch's forward, its reduce-scatters in backward): a rank slowed in
  `backward` makes its peers' `forward` look slow. A peer's wait is at most the straggler's own
  excess, split over the peer's phases, so in each window only the rank with the largest excess
  (seconds over its peers' median) counts; a second, lesser straggler is named once the first is gone.
- absolute: the median over ranks of a phase against a baseline of the same model, mesh, batch and
  cluster profile, kept from earlier healthy runs (a JSON file under `failure.straggler_baseline_root`:
  per phase the median of the last BASELINE_RUNS runs that finished without a straggler or failure
  event): catches a slowdown that hits every rank at once, which no peer comparison can see.

Both judge windows of at least WINDOW_STEPS steps (several log intervals when `train.log_every` is
shorter), on rank 0 only: the other ranks only send their row in the step's all-reduce.
The times compared are `PhaseTimer.clock`'s: on a GPU the device time of the compute kernels of one
profiled step in every metrics.kernel_every, NCCL's left out (jobs/telemetry/kernels.py; CUDA event time
with kernel_every=0); on a CPU rank the wall time of the rank's own work, its CPU time plus the time it
was descheduled (a rank waiting for its peers in gloo sleeps and counts neither; a rank stopped or
throttled from outside counts the stop; see jobs/telemetry/phases.py). Each detection is a `straggler` event (`check` = relative | absolute); with
`failure.exclude_stragglers=true` a relative straggler's node goes on the run's quarantine list.
The first window of an attempt (warm-up) is neither judged nor kept for the baseline.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from jobs.telemetry.phases import PhaseTimer

__all__ = [
    "Detection",
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


@dataclass(frozen=True, slots=True)
class Detection:
    check: str  # relative | absolute
    phase: str
    ranks: list[int] | str  # the straggling ranks, or "all"
    ratio: float  # phase time / reference (peers' median, or the baseline)
    seconds: float  # the phase's median seconds per step in the window
    reference_s: float


@dataclass
class StragglerDetector:
    """Pure: feed it one [ranks x phases] matrix of median seconds per step per window."""

    names: tuple[str, ...]
    ratio: float = 1.1
    intervals: int = 3
    min_diff_s: float = 0.005
    baseline: dict[str, float] | None = None
    groups: list[int] | None = None  # per rank: ranks compare only with peers of the same group (pipeline stage)
    _rel: dict[tuple[int, str], int] = field(default_factory=dict)
    _abs: dict[str, int] = field(default_factory=dict)

    def observe(self, m: np.ndarray) -> list[Detection]:
        """Detections that reached `intervals` consecutive windows with this one (each streak once)."""
        return self._relative(m) + self._absolute(m)

    def _slow(self, v: float, ref: float) -> bool:
        return v > ref * self.ratio and v - ref > self.min_diff_s

    def _relative(self, m: np.ndarray) -> list[Detection]:
        """Counts only the rank with the largest excess over its peers (see the module docstring)."""
        ref = peer_medians(m, self.groups)
        judged = np.array([n not in NOT_JUDGED for n in self.names])
        with np.errstate(invalid="ignore"):
            hit = (m > ref * self.ratio) & (m - ref > self.min_diff_s) & judged
        slow = {(int(r), self.names[j]): (float(m[r, j]), float(ref[r, j])) for r, j in zip(*np.nonzero(hit))}
        top = max(slow, key=lambda k: slow[k][0] - slow[k][1])[0] if slow else None
        out = []
        for key in set(self._rel) | set(slow):
            n = self._rel.get(key, 0) + 1 if key in slow and key[0] == top else 0
            self._rel[key] = n
            if n == self.intervals:
                v, ref = slow[key]
                out.append(Detection("relative", key[1], [key[0]], v / ref, v, ref))
        return sorted(out, key=lambda d: (d.ranks, self.names.index(d.phase)))

    def _absolute(self, m: np.ndarray) -> list[Detection]:
        out = []
        for j, name in enumerate(self.names):
            ref = (self.baseline or {}).get(name)
            if name in NOT_JUDGED or not ref:
                continue
            v = float(np.median(m[:, j]))
            n = self._abs.get(name, 0) + 1 if self._slow(v, ref) else 0
            self._abs[name] = n
            if n == self.intervals:
                out.append(Detection("absolute", name, "all", v / ref, v, ref))
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
    [phases] vector and, on rank 0 only, the straggler checks and their events; at the end of a healthy
    run, the baseline. `gather(vector) -> [ranks x phases]` is the collective (a seam for tests)."""

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
        self._matrix: np.ndarray | None = None  # [ranks x phases] from this window's all-reduce (`incoming`)
        self._window = 0  # steps ended in the window so far (alike on every rank)
        self.history: list[np.ndarray] = []  # rank 0: the medians over ranks of each judged window
        self.found: list[Detection] = []  # rank 0: what the checks named
        self._first = True

    def _window_ends(self, *, interval_end: bool, ended: int) -> bool:
        return interval_end and ended >= self.window_steps

    def outgoing(self, *, interval_end: bool) -> np.ndarray | None:
        """At the last step of a window, before its all-reduce: this rank's window medians (the steps ended
        so far) in its row of a zero [ranks x phases] matrix, flattened, to ride in the trainer's one
        all-reduce per step (a separate collective cost 14% of a step on 8 ranks sharing 2 cores).
        None otherwise: every rank decides alike from the step number, so the tensors match."""
        if not self._window_ends(interval_end=interval_end, ended=self._window + 1) or not self.timer.enabled:
            return None
        m = np.zeros((len(self.nodes), len(self.timer.names)))
        m[self.rank] = self.timer.take_interval()
        return m.ravel()

    def incoming(self, flat: np.ndarray) -> None:
        """The all-reduced `outgoing` matrix: every rank's row, judged at `step_done`."""
        self._matrix = flat.reshape(len(self.nodes), len(self.timer.names))

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
            m = self.gather(self.timer.take_interval())
        if self._first:  # warm-up: lazy init, first collectives
            self._first = False
            return
        if self.rank != 0:  # the checks run once, on rank 0, which reports
            return
        self.history.append(np.median(m, axis=0))
        for d in self.detector.observe(m):
            self.found.append(d)
            self._report(d, step)

    def _report(self, d: Detection, step: int) -> None:
        nodes = sorted({self.nodes[r] for r in d.ranks}) if d.ranks != "all" else sorted(set(self.nodes))
        self.emit(
            "straggler",
            check=d.check,
            phase=d.phase,
            ranks=d.ranks,
            nodes=nodes,
            ratio=round(d.ratio, 4),
            seconds=d.seconds,
            reference_s=d.reference_s,
            clock=self.timer.clock,
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
