"""`python -m jobs.status [run.dir=]RUN_DIR`: every attempt of a live or finished run, and what Slurm says of its jobs.

Reads only the run dir (`events.jsonl`, `metrics.jsonl`, `heartbeats/`, `incidents/`) and, when `sacct` is on PATH, the accounting
records of the run's Slurm jobs (`sacct --duplicates`: one line per attempt, requeues included). An attempt
that wrote no end but is dead (its job ended, or its heartbeats went stale) is named, with when it died.
Exit code 0; 2 when RUN_DIR has no ledger.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from jobs import exitcodes
from jobs.commands import run_dir_args
from jobs.events import read_events
from jobs.failure.ledger import attempts, render_summary
from jobs.launch.slurm_state import sacct_attempts
from jobs.records import load_json
from jobs.telemetry.run_report import dead_attempts

__all__ = ["main", "status_text"]


def status_text(run_dir: Path) -> str:
    """The summary `jobs.status` prints: the attempts table, the newest incident, the Slurm records."""
    events = read_events(run_dir / "events.jsonl")
    rows = attempts(events)
    lines = [f"run {run_dir}", render_summary(events)]
    jobs = list(dict.fromkeys(a.job_id for a in rows if a.job_id))
    records = {job: sacct_attempts(job) for job in jobs}
    metrics = [m for m in read_events(run_dir / "metrics.jsonl") if "step" in m and m.get("record") != "eval"]
    dead = dead_attempts(
        run_dir,
        rows,
        events,
        metrics,
        now=time.time(),
        sacct_records=[r for recs in records.values() for r in recs] if jobs else None,
    )
    lines += [
        f"attempt {a} is not running although it wrote no end: it died at "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(c.end))} ({c.by})"
        for a, c in dead.items()
    ]
    decisions = [e for e in events if e.get("kind") == "decision"]
    if decisions:
        d = decisions[-1]
        lines.append(f"last decision: {d.get('action')} ({d.get('reason')}); exit code {d.get('exit_code')}")
    lines += [
        f"spare swap after attempt {e.get('attempt')}: "
        + ", ".join(f"{bad} -> {spare}" for bad, spare in (e.get("swapped") or {}).items())
        for e in events
        if e.get("kind") == "spare_swap"
    ]
    incidents = sorted((run_dir / "incidents").glob("*/incident.json"), key=lambda p: p.stat().st_mtime)
    if incidents:
        inc = load_json(incidents[-1])
        lines.append(f"newest incident ({incidents[-1].parent.name}): {inc['cls']}: {inc['summary']}")
    for job in jobs:
        recs = records[job]
        if recs:
            lines.append(f"slurm job {job} (sacct --duplicates):")
            lines += [f"  {r}" for r in _fmt_sacct(recs)]
    return "\n".join(lines)


def _fmt_sacct(recs: list[dict]) -> list[str]:
    keys = [k for k in ("JobID", "State", "ExitCode", "Restarts", "NodeList", "Start", "End") if k in recs[0]]
    return ["  ".join(f"{k}={r.get(k)}" for k in keys) for r in recs]


def main(argv: list[str] | None = None) -> int:
    parsed = run_dir_args("status", list(sys.argv[1:] if argv is None else argv), "what it shows")
    if isinstance(parsed, int):
        return parsed
    _, run_dir = parsed
    print(status_text(run_dir))
    return exitcodes.OK


if __name__ == "__main__":
    sys.exit(main())
