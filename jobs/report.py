"""`python -m jobs.report RUN_DIR [--out DIR] [--no-plan]`: goodput, attempts and their causes, phases; plots and one HTML page.

Prints the text tables and writes `loss.png`, `goodput.png` (`phases.png` with `telemetry/`) and
`report.html` into `--out` (default RUN_DIR/report). Reads only the run dir, `sacct` when it is on
PATH (queue wait; the end of an attempt that died without writing one), and plans `config.yaml` with
`jobs.plan`'s own planner (analytic, no fake backend) for the expected goodput, unless `--no-plan`: Daly's
expected time for the productive time measured, with the plan's save, failure and restart costs, plus
one start-up. Works on a run that is still going.
Exit code 0; 2 when RUN_DIR has no ledger.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jobs import exitcodes
from jobs.events import read_events
from jobs.failure.ledger import attempts
from jobs.launch.slurm_state import SACCT_FIELDS, sacct_attempts
from jobs.telemetry.run_report import collect, render_text, write_report

__all__ = ["main", "plan_costs", "sacct_records"]


def plan_costs(run_dir: Path) -> dict[str, float] | None:
    """The costs `jobs.plan` plans for the run's `config.yaml` (checkpoint interval and blocking save,
    job MTBF, restart; a start-up costs what a restart does), as jobs.telemetry.goodput.expected_goodput's
    keywords but solve_s; None when it cannot be planned, without checkpoints, or with a cost unknown."""
    from omegaconf import OmegaConf

    from jobs.config import JobConfig
    from jobs.planner.gate import build_plan

    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(JobConfig), OmegaConf.load(run_dir / "config.yaml")))
        k = build_plan(cfg, measure=False).checkpoint
        costs = {"interval_s": k["interval_s"], "blocking_s": k["blocking_s"], "mtbf_s": k["mtbf_s"],
                 "restart_s": k["restart_s"], "startup_s": k["restart_s"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"warning: no expected goodput: jobs.plan could not plan {run_dir}/config.yaml: {e}", file=sys.stderr)
        return None
    if not cfg.checkpoint.enabled or not all(isinstance(v, (int, float)) for v in costs.values()):
        print("warning: no expected goodput: checkpoint.enabled=false or a cost jobs.plan does not know", file=sys.stderr)
        return None
    return {name: float(v) for name, v in costs.items()}


def sacct_records(run_dir: Path) -> list[dict[str, str]] | None:
    """The Slurm records (Submit, Start) of the run's jobs; None for a local run or without accounting."""
    jobs = list(dict.fromkeys(a.job_id for a in attempts(read_events(run_dir / "events.jsonl")) if a.job_id))
    recs = [r for j in jobs for r in sacct_attempts(j, fields=(*SACCT_FIELDS, "Submit"))]
    return recs or None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jobs.report", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--out", type=Path, help="where the plots and report.html go (default RUN_DIR/report)")
    p.add_argument("--no-plan", action="store_true", help="skip the expected goodput (planning imports torch)")
    args = p.parse_args(argv)
    if not (args.run_dir / "events.jsonl").exists():
        print(f"error: {args.run_dir}/events.jsonl not found: not a meshjob run dir", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    data = collect(args.run_dir, sacct_records=sacct_records(args.run_dir),
                   costs=None if args.no_plan else plan_costs(args.run_dir))
    print(render_text(data))
    written = write_report(data, args.out or args.run_dir / "report")
    print("\nwrote " + ", ".join(str(w) for w in written))
    return exitcodes.OK


if __name__ == "__main__":
    sys.exit(main())
