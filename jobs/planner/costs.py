"""The save and restart costs behind the checkpoint interval and the expected goodput, each with its
source: the run's own ledger (`run.dir/events.jsonl`) when it has them, else the cluster profile
(calibrated or cited), else an explicit user assumption (`plan.save_fixed_s`, `plan.restart_overhead_s`).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from jobs.events import read_events

__all__ = ["Cost", "ledger_costs", "save_cost", "restart_cost"]


@dataclass(frozen=True, slots=True)
class Cost:
    seconds: float
    source: str
    known: bool = True  # False: `seconds` leaves out a part nobody measured or assumed (a lower bound)


def _metrics(run_dir: Path) -> list[dict]:
    p = run_dir / "metrics.jsonl"
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def ledger_costs(run_dir: str | Path) -> tuple[Cost | None, Cost | None]:
    """(blocking save, restart) measured by the run itself: the median `blocking_s` of its
    filesystem-tier `checkpoint_saved` events; the mean time from a failed attempt's end to the next first step
    (jobs.telemetry.goodput's MTTR), else the median start-up (attempt start to its first step)."""
    from jobs.telemetry.goodput import measure_goodput

    path = Path(run_dir) / "events.jsonl"
    events = read_events(path)
    if not events:
        return None, None
    saves = [
        float(e["blocking_s"])
        for e in events
        if e.get("kind") == "checkpoint_saved" and "blocking_s" in e and e.get("tier", "filesystem") == "filesystem"
    ]  # the RAM tier's saves cost another interval's
    save = Cost(statistics.median(saves), f"median blocking_s of {len(saves)} saves in {path}") if saves else None
    g = measure_goodput(events, _metrics(Path(run_dir)), now=max(e["time"] for e in events))
    if g.mttr_s is not None:
        return save, Cost(g.mttr_s, f"MTTR of {g.failures} failures in {path}")
    starts = {e["attempt"]: e["time"] for e in events if e.get("kind") == "attempt_start"}
    firsts = {e["attempt"]: e["time"] for e in events if e.get("kind") == "first_step" and e["attempt"] in starts}
    ups = [firsts[a] - starts[a] for a in firsts]
    restart = (
        Cost(statistics.median(ups), f"median start-up (attempt_start to first_step) of {len(ups)} attempts in {path}")
        if ups
        else None
    )
    return save, restart


def save_cost(
    *,
    ledger: Cost | None,
    override: float | None,
    async_mode: str,
    write_s: float,
    stage_s: float,
    fsync_s: float,
    profile: str,
) -> Cost:
    """Blocking seconds of one save: the ledger's, else moving the bytes (the whole write when
    synchronous, the staging copy when async) plus one commit (`cluster.fs_fsync_s`), plus
    `plan.save_fixed_s` when the user sets one."""
    if ledger is not None and override is None:
        return ledger
    moved = write_s if async_mode == "none" else stage_s
    what = "cluster.fs_write_GBps" if async_mode == "none" else "cluster.host_copy_GBps"
    src = f"{what} + cluster.fs_fsync_s ({profile})"
    if override is not None:
        return Cost(moved + override, f"{what} ({profile}) + plan.save_fixed_s={override:g} (user assumption)")
    if fsync_s <= 0:
        return Cost(
            moved,
            f"{what} ({profile}) only: cluster.fs_fsync_s not measured and no ledger, so the save's "
            "fixed costs (DCP planning, commit) are not counted: a lower bound (set plan.save_fixed_s)",
            known=False,
        )
    return Cost(moved + fsync_s, src)


def restart_cost(*, ledger: Cost | None, override: float | None, load_s: float, profile: str) -> Cost:
    """Failure to training again: the ledger's, else loading the checkpoint at the profile's
    filesystem bandwidth plus `plan.restart_overhead_s` (requeue, start, rendezvous) when the user
    sets one; without either, the load alone, and the source says the rest is unknown."""
    if override is not None:
        return Cost(
            load_s + override,
            f"load at cluster.fs_write_GBps ({profile}) + plan.restart_overhead_s={override:g} (user assumption)",
        )
    if ledger is not None:
        return ledger
    return Cost(
        load_s,
        f"unknown: the load at cluster.fs_write_GBps ({profile}) only; no ledger in run.dir and no "
        "plan.restart_overhead_s, so requeue/start/rendezvous time is not counted",
        known=False,
    )
