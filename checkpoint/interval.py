"""The checkpoint interval from the MTBF and the save cost (Young 1974, Daly 2006), and what it costs.

All times are in seconds. `delta` is the blocking save cost (what training loses per save),
`mtbf` the job's mean time between failures, `restart` the time from a failure to training again.
The interval τ is the compute time between two saves, excluding the save itself (Daly's convention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "young_interval",
    "daly_interval",
    "expected_wall_time",
    "IntervalPlan",
    "plan_interval",
    "job_mtbf_s",
    "failures_in_ledger",
    "interval_steps",
    "NOT_FAILURES",
]


def young_interval(delta: float, mtbf: float) -> float:
    """Young's first-order optimum: τ = sqrt(2 δ M)."""
    _check(delta, mtbf)
    return math.sqrt(2.0 * delta * mtbf)


def daly_interval(delta: float, mtbf: float) -> float:
    """Daly's higher-order optimum (Daly 2006, eq. 37).

    τ = sqrt(2δM) · [1 + (1/3)·sqrt(δ/(2M)) + (1/9)·(δ/(2M))] − δ   for δ < 2M,
    τ = M                                                           for δ ≥ 2M.
    """
    _check(delta, mtbf)
    if delta >= 2.0 * mtbf:
        return mtbf
    x = delta / (2.0 * mtbf)
    return math.sqrt(2.0 * delta * mtbf) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - delta


def expected_wall_time(solve_time: float, *, tau: float, delta: float, mtbf: float, restart: float) -> float:
    """Daly's expected wall time to finish `solve_time` of work (Daly 2006, eq. 20, exponential failures).

    T_w = M · e^{R/M} · (e^{(τ+δ)/M} − 1) · T_s / τ
    """
    _check(delta, mtbf)
    if tau <= 0:
        raise ValueError(f"interval τ must be > 0, got {tau}")
    return mtbf * math.exp(restart / mtbf) * math.expm1((tau + delta) / mtbf) * solve_time / tau


@dataclass(frozen=True, slots=True)
class IntervalPlan:
    interval_s: float  # compute time between saves (Daly)
    young_s: float  # Young's first-order interval, the cross-check
    delta_s: float  # blocking save cost used
    mtbf_s: float  # job MTBF used
    restart_s: float  # restart cost used
    goodput: float  # expected useful fraction of wall time, T_s / T_w
    checkpoint_overhead: float  # fraction of wall time spent in blocking saves, δ / (τ + δ)
    expected_lost_work_s: float  # expected recomputation per failure, about (τ + δ) / 2

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.__slots__}


def plan_interval(*, delta: float, mtbf: float, restart: float = 0.0) -> IntervalPlan:
    """The Daly interval with its expected goodput, overhead and lost work per failure."""
    tau = daly_interval(delta, mtbf)
    wall = expected_wall_time(1.0, tau=tau, delta=delta, mtbf=mtbf, restart=restart)
    return IntervalPlan(
        interval_s=tau,
        young_s=young_interval(delta, mtbf),
        delta_s=delta,
        mtbf_s=mtbf,
        restart_s=restart,
        goodput=1.0 / wall,
        checkpoint_overhead=delta / (tau + delta),
        expected_lost_work_s=(tau + delta) / 2.0,
    )


def _check(delta: float, mtbf: float) -> None:
    if delta <= 0:
        raise ValueError(f"save cost δ must be > 0 seconds, got {delta}")
    if mtbf <= 0:
        raise ValueError(f"MTBF must be > 0 seconds, got {mtbf}")


# Ledger events that are not failures of the machine: the job was stopped on purpose.
NOT_FAILURES = frozenset(
    {"preempted", "walltime", "config_error", "nan_loss", "loss_spike", "non_finite_loss"}
)  # deliberate stops, bad input


def job_mtbf_s(
    *,
    mtbf_job_hours: float | None,
    mtbf_node_hours: float,
    nodes: int,
    failures_seen: int = 0,
    observed_s: float = 0.0,
) -> float:
    """The job's MTBF in seconds.

    The prior is `mtbf_job_hours` when given, else `mtbf_node_hours / nodes` (independent nodes,
    exponential failures). When this run's ledger has seen k >= 1 failures over `observed_s`
    seconds, the estimate is the posterior mean with the prior counted as one pseudo-failure:
    (M_prior + T_observed) / (1 + k). With no failures seen the prior stands.
    """
    if nodes < 1:
        raise ValueError(f"launcher.nodes({nodes}) must be >= 1")
    if mtbf_job_hours is not None:
        if mtbf_job_hours <= 0:
            raise ValueError(f"failure.mtbf_job_hours({mtbf_job_hours}) must be > 0")
        prior = mtbf_job_hours * 3600.0
    else:
        if mtbf_node_hours <= 0:
            raise ValueError(f"failure.mtbf_node_hours({mtbf_node_hours}) must be > 0")
        prior = mtbf_node_hours * 3600.0 / nodes
    if failures_seen <= 0:
        return prior
    return (prior + max(0.0, observed_s)) / (1 + failures_seen)


def failures_in_ledger(events: list[dict]) -> tuple[int, float]:
    """(failures, seconds observed) from a run's events.jsonl records.

    A failure is a `failure` event whose class (`class` or `cls`) is not a deliberate stop or bad
    input (preempted, walltime, config_error, nan_loss, loss_spike, non_finite_loss); an attempt counts once (its `attempt` id,
    else its `restart` count), whoever reported it: a survivor or the next attempt for a dead rank.
    The observed time spans the first to the last event.
    """
    if not events:
        return 0, 0.0
    times = [float(e["time"]) for e in events if "time" in e]
    failures = len(
        {
            e.get("attempt") or e.get("restart", 0)
            for e in events
            if e.get("kind") == "failure" and e.get("class", e.get("cls")) not in NOT_FAILURES
        }
    )
    return failures, (max(times) - min(times)) if times else 0.0


def interval_steps(interval_s: float, step_time_s: float) -> int:
    """The interval in optimizer steps: τ / step time, rounded, at least 1."""
    if step_time_s <= 0:
        raise ValueError(f"step time must be > 0 seconds, got {step_time_s}")
    return max(1, round(interval_s / step_time_s))
