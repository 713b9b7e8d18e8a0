"""failure.max_requeues counts the requeues that faults cause, not the routine ones: a time limit or a
preemption after committed progress is free, as submitit spends its countdown on timeouts only; a stop notice
without progress counts, and the no-progress breaker still stops a loop."""

from __future__ import annotations

import os
from pathlib import Path

from jobs import exitcodes
from jobs.config import FailureConfig
from jobs.events import EventLog, read_events
from jobs.failure.policy import decide, requeues_used
from jobs.failure.respond import AttemptContext, conclude
from tests.unit.test_requeue_path import _job, slurm  # noqa: F401 - slurm: the stand-in fixture


def _attempt(events: EventLog, attempt: str, *, start: int, saved: int | None) -> None:
    events.attempt = attempt
    events.emit("attempt_start", job_id="9")
    events.emit("train_start", step=start)
    if saved is not None:
        events.emit("checkpoint_saved", step=saved)


def _stop(run_dir: Path, events: EventLog, *, restart: int, cfg: FailureConfig) -> int:
    _job(Path(os.environ["FAKE_SLURM"]), state="RUNNING", restarts=restart)  # the requeued job runs
    ctx = AttemptContext(
        run_dir=str(run_dir),
        attempt=events.attempt,
        rank=0,
        world_size=2,
        job_id="9",
        restart_count=restart,
        cfg=cfg,
        events=events,
        nodes_needed=2,
    )
    return conclude(ctx, cause="SIGUSR2", step=None)


def test_a_second_time_limit_after_progress_is_requeued_under_max_requeues_1(tmp_path: Path, slurm: Path) -> None:
    # Reproduced on the cluster before: failure.max_requeues=1, the second USR2 -> stop 76, the job FAILED.
    cfg = FailureConfig(max_requeues=1, heartbeat_s=0.05)
    events = EventLog(tmp_path / "events.jsonl", rank=0)
    for restart in range(3):
        _attempt(events, f"9.{restart}", start=10 * restart, saved=10 * restart + 10)
        assert _stop(tmp_path, events, restart=restart, cfg=cfg) == exitcodes.REQUEUE
    decisions = read_events(tmp_path / "events.jsonl", "decision")
    assert [(d["action"], d["free"], d["requeues_used"]) for d in decisions] == [("requeue", True, 0)] * 3
    assert decisions[-1]["reason"] == (
        "SIGUSR2: requeue after committed progress, not counted against failure.max_requeues(1) (0 counted so far)"
    )
    assert _job(slurm)["restarts"] == 3
    assert requeues_used(read_events(tmp_path / "events.jsonl"), restart_count=3) == 0


def test_a_stop_notice_without_progress_counts_and_the_budget_still_stops(tmp_path: Path, slurm: Path) -> None:
    cfg = FailureConfig(max_requeues=1, max_attempts_without_progress=5, heartbeat_s=0.05)
    events = EventLog(tmp_path / "events.jsonl", rank=0)
    _attempt(events, "9.0", start=0, saved=10)  # free
    assert _stop(tmp_path, events, restart=0, cfg=cfg) == exitcodes.REQUEUE
    _attempt(events, "9.1", start=10, saved=None)  # no checkpoint before the notice: counted, 1 of 1
    assert _stop(tmp_path, events, restart=1, cfg=cfg) == exitcodes.REQUEUE
    _attempt(events, "9.2", start=10, saved=None)
    assert _stop(tmp_path, events, restart=2, cfg=cfg) == exitcodes.STOPPED
    decisions = read_events(tmp_path / "events.jsonl", "decision")
    assert [(d["action"], d["free"], d["requeues_used"]) for d in decisions] == [
        ("requeue", True, 0),
        ("requeue", False, 0),
        ("stop", False, 1),
    ]


def test_the_no_progress_breaker_stops_a_loop_of_stop_notices_without_progress() -> None:
    events = []
    for n in range(3):
        events += [
            {"kind": "attempt_start", "attempt": f"9.{n}", "time": n},
            {"kind": "train_start", "attempt": f"9.{n}", "time": n, "step": 10},
        ]
    cfg = FailureConfig(max_requeues=50, max_attempts_without_progress=3)
    d = decide(events, cause="SIGUSR2", cfg=cfg, restart_count=2)
    assert (d.action, d.exit_code, d.free) == ("stop", exitcodes.STOPPED, False), d


def test_faults_and_a_dead_supervisor_still_spend_the_budget() -> None:
    events = [
        {"kind": "attempt_start", "attempt": "9.1", "time": 0},
        {"kind": "train_start", "attempt": "9.1", "time": 0, "step": 10},
        {"kind": "checkpoint_saved", "attempt": "9.1", "time": 1, "step": 20},
    ]
    cfg = FailureConfig(max_requeues=1)
    assert decide(events, cause="hung_rank", cfg=cfg, restart_count=1).action == "stop"
    d = decide(events, cause="SIGTERM", cfg=cfg, restart_count=1, slurm="supervisor_died")
    assert (d.action, d.free) == ("stop", False), d
    # Slurm's count of a job whose earlier requeues the ledger does not hold (lost attempts) still counts.
    assert requeues_used([], restart_count=4) == 4


def test_the_guards_usr2_after_a_dead_supervisor_is_a_fault_and_counts() -> None:
    # The guard records `supervisor_died` and sends the ranks USR2; their decider sees a stop notice.
    events = [
        {"kind": "attempt_start", "attempt": "9.0", "time": 0},
        {"kind": "train_start", "attempt": "9.0", "time": 0, "step": 0},
        {"kind": "checkpoint_saved", "attempt": "9.0", "time": 1, "step": 20},
        {"kind": "failure", "attempt": "9.0", "time": 2, "cls": "supervisor_died", "suspects": []},
    ]
    d = decide(events, cause="SIGUSR2", cfg=FailureConfig(max_requeues=1), restart_count=0)
    assert (d.action, d.free, d.reason) == ("requeue", False, "SIGUSR2: requeue 1 of failure.max_requeues(1)"), d
    assert decide(events, cause="SIGUSR2", cfg=FailureConfig(max_requeues=1), restart_count=1).action == "stop"
