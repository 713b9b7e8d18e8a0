"""`python -m jobs.report [run.dir=]RUN_DIR [report.out=DIR] [report.plan=false]`: goodput, attempts and their
causes, phases; plots and one HTML page.

Prints the text tables and writes `loss.png`, `goodput.png` (`phases.png` with `telemetry/`) and
`report.html` into `report.out` (default RUN_DIR/report). Reads only the run dir, `sacct` when it is on
PATH (queue wait; the end of an attempt that died without writing one), and plans `config.yaml` with
`jobs.plan`'s own planner (analytic, no fake backend) for the expected goodput, unless `report.plan=false`: Daly's
expected time for the productive time measured, with the plan's save, failure and restart costs, plus
one start-up. Works on a run that is still going.
Exit code 0; 2 when RUN_DIR has no ledger.
"""

from __future__ import annotations

import sys
from pathlib import Path

from jobs import exitcodes
from jobs.commands import run_dir_args
from jobs.events import read_events
from jobs.extras import MissingExtra
from jobs.failure.ledger import attempts
from jobs.launch.slurm_state import SACCT_FIELDS, sacct_attempts
from jobs.telemetry.run_report import collect, render_text, write_report

__all__ = ["main", "plan_costs", "sacct_records"]


def plan_costs(run_dir: Path) -> tuple[dict[str, float] | None, str]:
    """The costs `jobs.plan` plans for the run's `config.yaml` (checkpoint interval and blocking save,
    job MTBF, restart; a start-up costs what a restart does), as jobs.telemetry.goodput.expected_goodput's
    keywords but solve_s, and ""; or None and why there is no expected goodput: it cannot be planned, no
    checkpoints, or the planner's "unknown" (a restart cost it does not know: never a number that looks measured)."""
    from omegaconf import OmegaConf

    from jobs.config import JobConfig
    from jobs.planner.gate import build_plan

    try:
        cfg = OmegaConf.to_object(
            OmegaConf.merge(OmegaConf.structured(JobConfig), OmegaConf.load(run_dir / "config.yaml"))
        )
        cfg.run.dir = str(run_dir)  # the planner reads this run dir's ledger, also after a move or a copy
        plan = build_plan(cfg, measure=False)
        k = plan.checkpoint
        costs = {
            "interval_s": k["interval_s"],
            "blocking_s": k["blocking_s"],
            "mtbf_s": k["mtbf_s"],
            "restart_s": k["restart_s"],
            "startup_s": k["restart_s"],
        }
    except (OSError, ValueError, KeyError, TypeError) as e:
        why = f"jobs.plan could not plan {run_dir}/config.yaml: {e}"
    else:
        why = _why_no_expected(
            checkpoints=cfg.checkpoint.enabled, goodput=plan.goodput_expected, ledger_dir=cfg.run.dir, costs=costs
        )
    if why:
        print(f"warning: no expected goodput: {why}", file=sys.stderr)
        return None, why
    return {name: float(v) for name, v in costs.items()}, ""


def _why_no_expected(*, checkpoints: bool, goodput: float | None, ledger_dir: str, costs: dict) -> str:
    """Why a plan gives no expected goodput ("" when it gives one); `ledger_dir`: the run.dir it planned with."""
    if not checkpoints:
        return "checkpoint.enabled=false: every failure starts again from step 0"
    if goodput is None:  # the planner's "unknown" (jobs.planner.checks.GOODPUT_UNKNOWN)
        return (
            f"unknown: jobs.plan does not know the restart cost (no attempt in the ledger of run.dir={ledger_dir} "
            "reached its first step, and plan.restart_overhead_s is not set); set plan.restart_overhead_s or run "
            "long enough to measure it"
        )
    if not all(isinstance(v, (int, float)) for v in costs.values()):
        return "a cost jobs.plan does not know"
    return ""


def sacct_records(run_dir: Path) -> list[dict[str, str]] | None:
    """The Slurm records (Submit, Start) of the run's jobs; None for a local run or without accounting."""
    jobs = list(dict.fromkeys(a.job_id for a in attempts(read_events(run_dir / "events.jsonl")) if a.job_id))
    recs = [r for j in jobs for r in sacct_attempts(j, fields=(*SACCT_FIELDS, "Submit"))]
    return recs or None


def main(argv: list[str] | None = None) -> int:
    parsed = run_dir_args("report", list(sys.argv[1:] if argv is None else argv), "its keys")
    if isinstance(parsed, int):
        return parsed
    keys, run_dir = parsed
    costs, why = plan_costs(run_dir) if keys.get("report.plan", True) else (None, "report.plan=false")
    data = collect(run_dir, sacct_records=sacct_records(run_dir), costs=costs, expected_why=why)
    print(render_text(data))
    try:
        written = write_report(data, Path(keys.get("report.out") or run_dir / "report"))
    except MissingExtra as e:
        print(f"error: {e}", file=sys.stderr)
        return exitcodes.ENV_ERROR
    print("\nwrote " + ", ".join(str(w) for w in written))
    return exitcodes.OK


if __name__ == "__main__":
    sys.exit(main())
