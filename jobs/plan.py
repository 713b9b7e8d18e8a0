"""`python -m jobs.plan [overrides]`: the zero-GPU readiness gate for the composed config at its full world size.

The planning itself is `jobs.planner` (`gate.build_plan`, arithmetic in `arith`); this entry point
prints its tables or JSON and maps the checks to an exit code: 0 every check passed; 1 a check
failed (each failure names the knob); 2 the config is invalid. Nothing is written.
"""

from __future__ import annotations

import json
import sys

from jobs import exitcodes
from jobs.cli import main_for
from jobs.config import JobConfig
from jobs.planner.gate import build_plan
from jobs.planner.render import render

__all__ = ["main", "run"]


def run(cfg: JobConfig) -> int:
    """Plans `cfg`, prints the tables (or JSON), returns the exit code."""
    if cfg.plan.search:
        return _search(cfg)
    try:
        plan = build_plan(cfg)
    except ValueError as e:
        if cfg.plan.json:
            print(json.dumps({"error": str(e), "checks": [{"name": "config", "ok": False, "why": str(e)}]}))
        else:
            print(f"config error: {e}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    if cfg.plan.json:
        print(json.dumps(plan.as_dict(), default=float))
    else:
        print(render(plan))
    failed = [c for c in plan.checks if not c.ok]
    if failed and not cfg.plan.json:
        print("\nnot ready: " + "; ".join(f"{c.name}: {c.why}" for c in failed), file=sys.stderr)
    return exitcodes.FAILED if failed else exitcodes.OK


def _search(cfg: JobConfig) -> int:
    """plan.search=true: the ranked table (jobs.planner.search); 1 when no shape is feasible."""
    from jobs.planner.search import render_search, search, write_top_k

    try:
        result = search(cfg)
    except ValueError as e:
        print(f"config error: {e}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    print(render_search(result, cfg, rows=cfg.plan.search_rows))
    if cfg.plan.search_top_k > 0:
        print(f"\ntop {cfg.plan.search_top_k}: overrides per point, then the -m sweep over all of them")
        print("\n".join(write_top_k(result, cfg, k=cfg.plan.search_top_k, out=cfg.plan.search_out)))
    return exitcodes.OK if result.ranked else exitcodes.FAILED


def main(argv: list[str] | None = None) -> int:
    return main_for(run, argv, command="plan", sweep_continues=True)  # a sweep plans every point


if __name__ == "__main__":
    exitcodes.exit_command(main())
