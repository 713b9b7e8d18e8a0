"""`python -m jobs.report`'s expected goodput: a number only when jobs.plan gives one, else the planner's reason."""

from __future__ import annotations

import json
from pathlib import Path

from jobs import report
from jobs.config import compose
from jobs.launch.prepare import config_yaml


def _run_died_in_start_up(tmp_path: Path, *overrides: str, first_step_at: float | None = None) -> Path:
    """A run dir whose one attempt died before its first step (unless `first_step_at`): its ledger then
    measures no start-up or restart."""
    run = tmp_path / "run"
    run.mkdir(parents=True)
    events = [
        {"time": 1000.0, "kind": "attempt_start", "rank": 0, "attempt": "local.0", "nodes": ["n1"]},
        {
            "time": 1030.0,
            "kind": "attempt_end",
            "rank": 0,
            "attempt": "local.0",
            "cause": "dead_rank",
            "action": "stop",
            "step": 0,
        },
    ]
    if first_step_at is not None:
        events.insert(1, {"time": first_step_at, "kind": "first_step", "rank": 0, "attempt": "local.0", "step": 1})
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "config.yaml").write_text(config_yaml(compose([f"run.dir={run}", *overrides])))
    return run


def test_unknown_restart_cost_prints_the_planners_reason_not_a_number(tmp_path: Path, capsys) -> None:
    run = _run_died_in_start_up(tmp_path)
    assert report.main([str(run), f"report.out={tmp_path / 'o'}"]) == 0
    captured = capsys.readouterr()
    head = next(line for line in captured.out.splitlines() if line.startswith("goodput: "))
    assert "expected: n/a (unknown: jobs.plan does not know the restart cost" in head, head
    assert "set plan.restart_overhead_s or run long enough to measure it" in head
    assert "expected (jobs.plan's costs" not in head and "could not plan" not in head
    assert "warning: no expected goodput: unknown: jobs.plan does not know the restart cost" in captured.err


def test_a_restart_cost_the_user_sets_gives_the_number(tmp_path: Path, capsys) -> None:
    costs, why = report.plan_costs(_run_died_in_start_up(tmp_path, "plan.restart_overhead_s=30"))
    assert why == "" and costs is not None and costs["restart_s"] >= 30.0 and costs["startup_s"] == costs["restart_s"]


def test_no_plan_and_no_checkpoints_say_so(tmp_path: Path, capsys) -> None:
    run = _run_died_in_start_up(tmp_path / "a")
    assert report.main([str(run), "report.plan=false", f"report.out={tmp_path / 'o'}"]) == 0
    assert "expected: n/a (report.plan=false)" in capsys.readouterr().out
    costs, why = report.plan_costs(_run_died_in_start_up(tmp_path / "b", "checkpoint.enabled=false"))
    assert costs is None and why.startswith("checkpoint.enabled=false")


def test_the_restart_cost_comes_from_the_reported_run_dirs_ledger_also_after_a_move(tmp_path: Path) -> None:
    run = _run_died_in_start_up(tmp_path / "before", first_step_at=1012.5)  # start-up 12.5 s in its ledger
    moved = run.rename(tmp_path / "after")  # config.yaml still says run.dir=<tmp>/before/run
    costs, why = report.plan_costs(moved)
    assert why == "" and costs is not None and costs["restart_s"] == 12.5
