"""Training health: a loss spike or a non-finite loss rolls the run back and skips the data that preceded it.

Decided at the step boundary from the step's global loss and grad norm, which the trainer's one
all-reduce makes identical on every rank (bit for bit), so every rank decides alike with no collective.

Detection (`observe`, a pure function of the detector state and the step's numbers): a step is
suspicious when its loss is above both `failure.spike_factor` x the baseline and that baseline +
`failure.spike_mad_k` x the MAD, both of the last `failure.spike_window` healthy losses without their trend
(`trend`: a robust line's value now, and the median absolute deviation from it; a robust z-score that follows a
falling curve: a noisy curve widens the bar, a quiet or smoothly falling one narrows it to the ratio), or its
grad norm above
`failure.spike_grad_norm`; both checks are armed once the window holds `spike_window` healthy steps (the
warm-up: early losses fall fast, early grad norms run high);
`failure.spike_patience` suspicious steps in a row are a `loss_spike`. A non-finite loss or grad norm
is a `non_finite_loss` at once (checked first: every comparison with NaN is False).

The step -> data step map. Step `i` (the one `Trainer.train_step(i)` runs: i steps done before it)
reads data step `data_step(i)`: with the rollback records' skip entries `(from_step, data_step)`,
the last entry with from_step <= i gives `data_step + (i - from_step)`; without one, `i` itself.
After a spike whose suspicious steps are `first..last`, the run goes back to the newest committed
checkpoint `s0 <= first` (its state predates the spike's first update) and skips the data window
that preceded the spike: the data steps that steps `w0..last` read, where
`w0 = max(s0, min(first, last - failure.spike_skip_steps + 1))` (the spike itself and up to
`spike_skip_steps - 1` steps before it, never past the checkpoint). Steps from `w0` on then read
the data after the spike; steps `s0..w0-1` are redone on the same data as before. The record also keeps the
global samples those data steps read (`skip_samples`, [start, end)), and the data reads past them by position
(jobs/data/sampler.py), so that a resume with another train.global_batch skips exactly those samples.

Every rollback is one record, in the run's order: written to `events.jsonl` (kind `rollback`) before
training goes on, and kept in `TrainState.health` (so every later checkpoint carries it). A resume
takes the union of both, by rollback number: a kill after a rollback but before the next checkpoint
loads a checkpoint that does not know the record, and one saved inside the spike window (past the
rollback's target) is replaced by the target. `failure.spike_lr_scale` multiplies the learning rate at
each rollback (the product of the records' scales, applied from the rollback on).

Before any of this, a suspicious step is re-run from the same state by jobs/failure/sdc.py (the trainer
asks `suspicious` before the optimizer step): values that differ on the re-run are hardware (an `sdc`
incident, the attempt ends); the same values are the data's, and the step goes on to `after_step` here.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from jobs.config import FailureConfig
from jobs.events import read_events
from jobs.failure.incident import Incident, incident_dir

if TYPE_CHECKING:  # annotations only: jobs.validate runs check_config on the login node without torch
    import torch

__all__ = [
    "Spike",
    "LossDiverged",
    "TrainingHealth",
    "observe",
    "suspicious",
    "data_step",
    "skip_entries",
    "skip_ranges",
    "parse_corrupt",
    "check_config",
    "check_retention",
    "CORRUPT_VAR",
    "DIVERGED_CLASSES",
]

CORRUPT_VAR = "MESHJOB_TEST_CORRUPT_DATA_STEP"  # tests only: "12,nan:20" corrupts data step 12's tokens, NaNs at 20
DIVERGED_CLASSES = frozenset({"loss_spike", "non_finite_loss"})

log = logging.getLogger("meshjob.health")
Load = Callable[[int | None], int]  # load(before_step) -> the step loaded (0: none); the trainer's checkpoint load


@dataclass
class Spike:
    cls: str  # loss_spike | non_finite_loss
    first: int  # the first suspicious step (steps done before it, as train_step numbers it)
    last: int  # the step that confirmed it
    losses: list[float]  # the suspicious steps' global losses
    grad_norms: list[float]
    median: float | None  # the running median it was compared with (None: not armed yet)
    reason: str


class LossDiverged(FloatingPointError):
    """The run cannot be rolled back (failure.max_rollbacks spent, or no checkpoint before the spike)."""

    def __init__(self, cls: str, summary: str) -> None:
        super().__init__(summary)
        self.cls = cls


def check_config(f: FailureConfig) -> None:
    """Config errors of the spike keys and of the SDC re-run that precedes a rollback (jobs/failure/sdc.py),
    naming the override and a value that works."""
    if f.sdc_rtol < 0:
        raise ValueError(f"failure.sdc_rtol({f.sdc_rtol}) must be >= 0; e.g. failure.sdc_rtol=1e-3")
    if f.replica_hash_every < 0:
        raise ValueError(
            f"failure.replica_hash_every({f.replica_hash_every}) must be >= 0 (0 = off); "
            "e.g. failure.replica_hash_every=100"
        )
    if f.spike_factor != 0 and f.spike_factor <= 1:
        raise ValueError(f"failure.spike_factor({f.spike_factor}) must be 0 (off) or > 1; e.g. failure.spike_factor=3")
    if f.spike_mad_k < 0:
        raise ValueError(
            f"failure.spike_mad_k({f.spike_mad_k}) must be >= 0 (0: the ratio alone); e.g. failure.spike_mad_k=8"
        )
    if f.spike_window < 1 or f.spike_patience < 1 or f.spike_skip_steps < 1:
        raise ValueError(
            f"failure.spike_window({f.spike_window}), failure.spike_patience({f.spike_patience}) and "
            f"failure.spike_skip_steps({f.spike_skip_steps}) must be >= 1"
        )
    if f.spike_grad_norm < 0 or f.max_rollbacks < 0 or f.rollback_window_steps < 0:
        raise ValueError(
            f"failure.spike_grad_norm({f.spike_grad_norm}) (0 = off), failure.max_rollbacks"
            f"({f.max_rollbacks}) and failure.rollback_window_steps({f.rollback_window_steps}) (0 = the "
            "whole run) must be >= 0"
        )
    if not 0 < f.spike_lr_scale <= 1:
        raise ValueError(f"failure.spike_lr_scale({f.spike_lr_scale}) must be in (0, 1]; 1 leaves the LR alone")


def check_retention(f: FailureConfig, *, enabled: bool, interval: str, every_steps: int, keep: int) -> None:
    """A spike is confirmed failure.spike_patience steps after its first step, and the checkpoints saved in
    between hold spiking updates; retention keeps checkpoint.keep of them, so with more than keep - 1 saves in
    that streak no checkpoint from before the spike is left to roll back to (checked for a fixed interval)."""
    if not enabled or interval != "steps" or every_steps <= 0 or f.spike_factor <= 0 and f.spike_grad_norm <= 0:
        return
    most = (keep - 1) * every_steps
    if f.spike_patience > most:
        raise ValueError(
            f"failure.spike_patience({f.spike_patience}) > (checkpoint.keep({keep}) - 1) x checkpoint.every_steps"
            f"({every_steps}) = {most}: while a spike is confirmed, retention deletes every checkpoint from before "
            f"it, leaving none to roll back to; set failure.spike_patience={most} (or less) or checkpoint.keep="
            f"{-(-f.spike_patience // every_steps) + 1}"
        )


def new_detector() -> dict[str, Any]:
    """The detector's state: recent healthy losses and the current streak of suspicious steps."""
    return {"history": [], "streak": []}


def observe(det: dict[str, Any], *, step: int, loss: float, grad_norm: float, cfg: FailureConfig) -> Spike | None:
    """Feeds one step's global numbers to the detector state `det` (updated in place); a Spike when confirmed."""
    streak = det["streak"]
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        streak.append([step, loss, grad_norm])
        return _spike("non_finite_loss", streak, None, f"loss {loss}, grad norm {grad_norm} at step {step + 1}")
    hist = det["history"]
    median, why = _reasons(det, loss=loss, grad_norm=grad_norm, cfg=cfg)
    if not why:
        hist.append(loss)
        del hist[: -cfg.spike_window]
        streak.clear()  # a streak that ends is forgotten, its losses never enter the median
        return None
    streak.append([step, loss, grad_norm])
    if len(streak) < cfg.spike_patience:
        return None
    return _spike(
        "loss_spike",
        streak,
        median,
        "; ".join(why) + f" for {len(streak)} step(s) (failure.spike_patience={cfg.spike_patience})",
    )


def suspicious(det: dict[str, Any], *, loss: float, grad_norm: float, cfg: FailureConfig) -> bool:
    """Whether this step is re-run before its optimizer step (jobs/failure/sdc.py): when `observe` would
    count it as suspicious (non-finite, or above a threshold), and when its grad norm is above
    failure.spike_grad_norm during the warm-up too (a re-run costs one step; a flipped bit is no less
    likely early on), which `observe` then does not count. Reads `det` without changing it."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        return True
    if cfg.spike_grad_norm > 0 and grad_norm > cfg.spike_grad_norm:
        return True
    return bool(_reasons(det, loss=loss, grad_norm=grad_norm, cfg=cfg)[1])


def _reasons(
    det: dict[str, Any], *, loss: float, grad_norm: float, cfg: FailureConfig
) -> tuple[float | None, list[str]]:
    """(the running median or None, why the finite step is suspicious: [] when it is not). Both checks are
    armed once the window holds failure.spike_window healthy steps: early losses fall fast and early grad
    norms run high (at initialisation, during the LR warm-up), and neither is a spike."""
    hist = det["history"]
    armed = len(hist) >= cfg.spike_window
    median, mad = trend(hist) if armed else (None, 0.0)
    why = []
    if cfg.spike_factor > 0 and median is not None:
        bar = max(cfg.spike_factor * median, median + cfg.spike_mad_k * mad)
        if loss > bar:
            why.append(
                f"loss {loss:.4g} > max(failure.spike_factor({cfg.spike_factor}) x baseline, baseline + "
                f"failure.spike_mad_k({cfg.spike_mad_k}) x MAD {mad:.3g}) = {bar:.4g} (baseline {median:.4g} and MAD "
                f"of the last failure.spike_window({cfg.spike_window}) losses, without their trend)"
            )
    if cfg.spike_grad_norm > 0 and armed and grad_norm > cfg.spike_grad_norm:
        why.append(f"grad norm {grad_norm:.4g} > failure.spike_grad_norm({cfg.spike_grad_norm})")
    return median, why


def trend(hist: list[float]) -> tuple[float, float]:
    """(baseline, noise) of the healthy losses without their trend. A robust line through them (its slope the
    median of the slopes between each loss and the one half the window later, its offset the median residual)
    gives the baseline, its value at the step being judged; the noise is the larger of two trend-free median
    absolute deviations: of the residuals, and of the first differences over sqrt(2) (false alarms cost a
    rollback each). A flat window gives its median and MAD; a falling one its level now (6 -> 3.5 over 60
    steps: 3.46, where the window's median, 4.5, lagged and the trend's spread, 0.52, let 7.06 pass)."""
    n = len(hist)
    if n < 2:
        return (hist[0] if hist else 0.0), 0.0
    h = max(1, n // 2)
    slope = statistics.median((hist[i + h] - hist[i]) / h for i in range(n - h))
    res = [x - slope * i for i, x in enumerate(hist)]
    mid = statistics.median(res)
    diffs = [b - a for a, b in zip(hist, hist[1:])]
    dmid = statistics.median(diffs)
    noise = max(
        statistics.median(abs(r - mid) for r in res), statistics.median(abs(d - dmid) for d in diffs) / math.sqrt(2)
    )
    return mid + slope * n, noise


def _spike(cls: str, streak: list, median: float | None, reason: str) -> Spike:
    return Spike(
        cls,
        first=streak[0][0],
        last=streak[-1][0],
        losses=[s[1] for s in streak],
        grad_norms=[s[2] for s in streak],
        median=median,
        reason=reason,
    )


def skip_entries(records: list[dict]) -> list[tuple[int, int]]:
    """The (from_step, data_step) entries of the rollback records, replayed in order: a rollback's entry
    replaces the entries of the timeline it rolled back over (from its from_step on)."""
    entries: list[tuple[int, int]] = []
    for r in records:
        entries = [e for e in entries if e[0] < r["from_step"]] + [(r["from_step"], r["data_step"])]
    return entries


def skip_ranges(records: list[dict]) -> list[tuple[int, int, int, int]]:
    """The data skips of the rollback records that still hold (replayed as `skip_entries`): (first data step
    jumped, the data step read after the jump, first global sample skipped, end of the range). Records from
    before the skip was kept as a sample range (no `skip_samples`) skip by data step only, as then."""
    kept: list[dict] = []
    for r in records:
        kept = [k for k in kept if k["from_step"] < r["from_step"]] + [r]
    return [(min(r["skipped_data_steps"]), r["data_step"], *r["skip_samples"]) for r in kept if "skip_samples" in r]


def data_step(step: int, entries: list[tuple[int, int]]) -> int:
    """The data step that step `step` reads under the skip entries."""
    base = next((e for e in reversed(entries) if e[0] <= step), None)
    return step if base is None else base[1] + step - base[0]


def parse_corrupt(text: str) -> dict[int, str]:
    """`MESHJOB_TEST_CORRUPT_DATA_STEP` -> {data step: "tokens" | "nan"}: "12,nan:20"."""
    out: dict[int, str] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        kind, _, num = item.rpartition(":")
        if kind not in ("", "tokens", "nan"):
            raise ValueError(f"{CORRUPT_VAR}={text!r}: {item!r} is not [tokens:|nan:]<data step>")
        out[int(num)] = kind or "tokens"
    return out


class TrainingHealth:
    """The trainer's side of training health: the step -> data step map, the check after each step, the
    rollback, and the resume that repeats every recorded skip. One per rank, all deciding alike."""

    def __init__(
        self,
        cfg: FailureConfig,
        *,
        rank: int,
        run_dir: str,
        attempt: str,
        emit: Callable[..., Any],
        events_path: os.PathLike[str] | str,
        vocab_size: int,
    ) -> None:
        check_config(cfg)
        self.cfg, self.rank, self.run_dir, self.attempt = cfg, rank, run_dir, attempt
        self._emit_fn, self.events_path, self.vocab_size = emit, events_path, vocab_size
        self.records: list[dict] = []  # every rollback of the run, in order (never rewound by a load)
        self.entries: list[tuple[int, int]] = []
        self.lr_scale = 1.0  # read by the trainer's LR schedule: the product of the rollbacks' scales
        self.corrupt = parse_corrupt(os.environ.get(CORRUPT_VAR, ""))
        self._ledger_count: int | None = None  # rollback records in events.jsonl at the first load (rank 0)
        self.data: Any = None  # the training BatchSource (`bind`): a rollback's skip is its sample range

    def bind(self, data: Any) -> None:
        """The training data (jobs.data.BatchSource): every rollback's skip is recorded as the global samples it
        jumps over (`skip_samples`) and the data reads past them by position, under any train.global_batch."""
        self.data = data
        data.skips = skip_ranges(self.records)

    def data_step(self, step: int) -> int:
        return data_step(step, self.entries)

    def fetch(self, data: Any, step: int, parts: list[torch.nn.Module]) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's batch for `step`, read at its data step (`data.batch(data_step)`); the test knob
        CORRUPT_VAR replaces a data step's targets by noise (a spike) or NaNs the parameters (non-finite)."""
        import torch  # lazy: a rank's method; this module's check_config runs on the login node (jobs.validate)

        d = self.data_step(step)
        inputs, targets = data.batch(d)
        kind = self.corrupt.get(d)
        if kind == "tokens":  # confident predictions against random targets: the loss jumps well above its median
            g = torch.Generator().manual_seed(d)
            targets = torch.randint(0, self.vocab_size, targets.shape, generator=g, dtype=targets.dtype)
        elif kind == "nan":  # a numerical blow-up: this rank's parameters (the rollback restores them)
            with torch.no_grad():
                for part in parts:
                    for p in part.parameters():
                        (p.to_local() if hasattr(p, "to_local") else p).fill_(float("nan"))
        return inputs, targets

    def suspicious(self, st: Any, *, loss: float, grad_norm: float) -> bool:
        """Whether step `st.step`'s global numbers make it suspicious (asked before its optimizer step,
        so that jobs/failure/sdc.py can re-run it first); changes nothing."""
        return suspicious(st.health.get("detector") or new_detector(), loss=loss, grad_norm=grad_norm, cfg=self.cfg)

    def after_step(self, st: Any, m: dict[str, Any], *, load: Load, schedulers: list[Any]) -> bool:
        """Checks step `st.step` (just trained, not yet recorded); True when it was a spike and the run
        rolled back (st is then the checkpoint's). Raises LossDiverged when it cannot roll back."""
        m["data_step"] = self.data_step(st.step)
        det = st.health.setdefault("detector", new_detector())
        spike = observe(det, step=st.step, loss=m["loss"], grad_norm=m["grad_norm"], cfg=self.cfg)
        if spike is None:
            return False
        self.rollback(st, spike, load=load, schedulers=schedulers)
        return True

    def rollback(self, st: Any, spike: Spike, *, load: Load, schedulers: list[Any]) -> None:
        n, recent = len(self.records) + 1, self._recent(spike)
        self._emit(
            "loss_spike",
            cls=spike.cls,
            step=spike.last + 1,
            first_step=spike.first + 1,
            losses=spike.losses,
            grad_norms=spike.grad_norms,
            median=spike.median,
            reason=spike.reason,
        )
        if recent >= self.cfg.max_rollbacks:
            raise LossDiverged(
                spike.cls, self._summary(spike, f"failure.max_rollbacks({self.cfg.max_rollbacks}) rollbacks are spent")
            )
        target = load(spike.first + 1)
        if target <= 0:
            raise LossDiverged(
                spike.cls,
                self._summary(
                    spike,
                    f"no committed checkpoint before step {spike.first + 1} "
                    "to roll back to (checkpoint.enabled, checkpoint.every_steps, "
                    "checkpoint.keep)",
                ),
            )
        w0 = max(target, min(spike.first, spike.last - self.cfg.spike_skip_steps + 1))
        skipped = [self.data_step(i) for i in range(w0, spike.last + 1)]
        span = {} if self.data is None else {"skip_samples": list(self.data.sample_span(min(skipped), max(skipped)))}
        record = {
            "rollback": n,
            "cls": spike.cls,
            "first_step": spike.first + 1,
            "step": spike.last + 1,
            "target_step": target,
            "from_step": w0,
            "data_step": max(skipped) + 1,
            "skipped_data_steps": skipped,
            "lr_scale": self.cfg.spike_lr_scale,
            **span,
        }
        self._apply(st, [*self.records, record], schedulers)
        self._emit("rollback", record=record, max_rollbacks=self.cfg.max_rollbacks, lr_scale_total=self.lr_scale)
        self._incident(spike, record)
        if self.rank == 0:
            log.warning(
                "%s at step %d (%s): rollback %d (%d of failure.max_rollbacks(%d) in the last failure."
                "rollback_window_steps(%d)) to step %d, data steps %s skipped, LR x %g",
                spike.cls,
                spike.last + 1,
                spike.reason,
                n,
                recent + 1,
                self.cfg.max_rollbacks,
                self.cfg.rollback_window_steps,
                target,
                _span(skipped),
                self.lr_scale,
            )

    def _recent(self, spike: Spike) -> int:
        """The rollbacks that count toward failure.max_rollbacks at this spike: those of a spike within the
        last failure.rollback_window_steps steps (every one when it is 0)."""
        w = self.cfg.rollback_window_steps
        return sum(1 for r in self.records if w == 0 or r["step"] > spike.last + 1 - w)

    def resume(self, st: Any, *, load: Load, schedulers: list[Any], agree: Callable[[Any], Any]) -> None:
        """After the trainer's first load: the rollback records of the checkpoint and of events.jsonl (rank
        0's read, `agree`d to every rank); a checkpoint past the target of a rollback it does not know
        was saved in that spike's window, and the newest one at or before the target replaces it."""
        ledger = agree(self._ledger_records() if self.rank == 0 else None)
        by_n = {r["rollback"]: r for r in [*st.health.get("rollbacks", []), *ledger]}
        records = [by_n[k] for k in sorted(by_n)]
        for _ in range(len(records)):
            known = {r["rollback"] for r in st.health.get("rollbacks", [])}
            past = [r["target_step"] for r in records if r["rollback"] not in known and st.step > r["target_step"]]
            if not past:
                break
            got = load(min(past) + 1)
            self._emit(
                "rollback_replayed",
                loaded_step=got,
                reason="the newest checkpoint was saved inside a "
                "rolled-back spike window and predates its rollback record",
            )
            if got <= 0:
                raise LossDiverged(records[-1]["cls"], f"rollback target step {min(past)} is gone (retention?)")
        if records:
            self._apply(st, records, schedulers)

    def _apply(self, st: Any, records: list[dict], schedulers: list[Any]) -> None:
        self.records = [dict(r) for r in records]
        self.entries = skip_entries(self.records)
        if self.data is not None:
            self.data.skips = skip_ranges(self.records)
        st.health["rollbacks"] = [dict(r) for r in self.records]
        scale = math.prod(r["lr_scale"] for r in self.records)
        if scale != self.lr_scale or scale != 1.0:
            self.lr_scale = scale
            for sched in schedulers:  # this step's LR again, now with the scale (LambdaLR.get_lr)
                lrs = [base * lam(sched.last_epoch) for lam, base in zip(sched.lr_lambdas, sched.base_lrs)]
                for g, lr in zip(sched.optimizer.param_groups, lrs):
                    g["lr"] = lr
                sched._last_lr = lrs

    def known_rollbacks(self) -> int:
        """The rollbacks this run has recorded: in this process, and (rank 0, before the first resume) in
        events.jsonl. A checkpoint load passes it on: a RAM step that knows fewer belongs to an abandoned timeline."""
        if self.rank == 0 and self._ledger_count is None:
            self._ledger_count = len({r["rollback"] for r in self._ledger_records()})
        return max(len(self.records), self._ledger_count or 0)

    def _ledger_records(self) -> list[dict]:
        return [e["record"] for e in read_events(self.events_path, "rollback") if e.get("rank") == 0 and "record" in e]

    def _summary(self, spike: Spike, why: str) -> str:
        done = (
            "; ".join(
                f"#{r['rollback']} {r['cls']} at step {r['step']} -> step {r['target_step']}, data steps "
                f"{_span(r['skipped_data_steps'])} skipped"
                for r in self.records
            )
            or "none"
        )
        return (
            f"{spike.cls} at step {spike.last + 1} ({spike.reason}), and {why}; rollbacks so far: {done}. "
            f"Lower optim.lr, check the data at those steps, or raise failure.max_rollbacks (per "
            f"failure.rollback_window_steps({self.cfg.rollback_window_steps}) steps; 0 = the whole run)"
        )

    def _incident(self, spike: Spike, record: dict) -> None:
        if self.rank != 0:
            return
        inc = Incident(
            spike.cls,
            self.attempt,
            self.rank,
            f"{spike.reason}; rolled back to step {record['target_step']}",
            evidence={"spike": asdict(spike), "rollback": record},
        )
        folder = incident_dir(self.run_dir, self.attempt)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".rollback-{record['rollback']}.json.tmp"
        tmp.write_text(json.dumps(asdict(inc), indent=1, default=str))
        os.replace(tmp, folder / f"rollback-{record['rollback']}.json")

    def _emit(self, kind: str, **fields: Any) -> None:
        if self.rank == 0:
            self._emit_fn(kind, **fields)


def _span(steps: list[int]) -> str:
    if steps and steps == list(range(steps[0], steps[-1] + 1)):
        return f"{steps[0]}..{steps[-1]}" if len(steps) > 1 else str(steps[0])
    return ",".join(map(str, steps))
