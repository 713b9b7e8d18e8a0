"""Goodput that stays right for a run that died without an end, a rollback, a save inside a log interval and a
slow failure detection: crafted ledgers and run dirs, every figure worked out by hand."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from jobs.failure.heartbeat import Beat, beat_path, write_beat
from jobs.launch import slurm_state
from jobs.telemetry import goodput
from jobs.telemetry.goodput import expected_goodput, measure_goodput
from jobs.telemetry.run_report import collect, render_text


def _ev(t: float, kind: str, attempt: str, **fields) -> dict:
    return {"time": t, "kind": kind, "rank": 0, "attempt": attempt, **fields}


def _row(attempt: str, trained: list[tuple[int, float, float]]) -> dict:
    """A metrics.jsonl line logged after the last of `trained` ([step, end time, step_time_s] per step)."""
    step, t, dt = trained[-1]
    return {
        "step": step,
        "loss": 5.0,
        "step_time_s": dt,
        "attempt": attempt,
        "time": t + 0.01,
        "trained_steps": [list(x) for x in trained],
    }


def _steps(first: int, last: int, *, t0: float, dt: float = 2.0) -> list[tuple[int, float, float]]:
    return [(j, t0 + (j - first + 1) * dt, dt) for j in range(first, last + 1)]


def _dead_run(tmp_path: Path) -> Path:
    """One Slurm attempt 7.0: start 1000, steps 1-10 from 1010 (2 s each, logged every 5), a checkpoint of step 4
    committed at 1018 (no blocking part), then every rank died (kill -9 of the whole job): no failure, no
    attempt_end. Heartbeats stopped at 1033."""
    run = tmp_path / "run"
    run.mkdir()
    events = [
        _ev(1000, "attempt_start", "7.0", job_id="7"),
        _ev(1010, "train_start", "7.0", step=0),
        _ev(1012, "first_step", "7.0", step=1, step_time_s=2.0),
        _ev(1018.5, "checkpoint_saved", "7.0", step=4, blocking_s=0.0, total_s=0.5),
    ]
    steps = _steps(1, 10, t0=1010)
    metrics = [_row("7.0", steps[:5]), _row("7.0", steps[5:])]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    write_beat(beat_path(run, "7.0", 0), Beat(0, 1, "h", "n1", 1033.0, 10, "train", 1030.0))
    return run


def test_a_dead_run_is_closed_at_its_last_heartbeat_and_its_goodput_does_not_fall_later(tmp_path: Path) -> None:
    run = _dead_run(tmp_path)
    soon, later = collect(run, now=1100.0), collect(run, now=100_000.0)
    assert not soon.running and not later.running
    # By hand: 1000 -> 1033 (last beat) = 33 s; productive steps 1-4 = 8 s (committed by the save of step 4);
    # steps 5-10 died with the attempt (12 s lost); startup 10 s; the 3 s after the last step (1030 -> 1033) are
    # failure detection (nobody decided anything).
    for d in (soon, later):
        g = d.goodput
        assert (g.start, g.end) == (1000.0, 1033.0)
        assert g.goodput == pytest.approx(8.0 / 33.0) and (g.steps_productive, g.steps_lost) == (4, 6)
        assert g.seconds["lost_work"] == pytest.approx(12.0)
        assert g.seconds["failure_detection"] == pytest.approx(3.0) and g.failures == 1
        assert g.closed["7.0"].by == "last heartbeat" and g.closed["7.0"].cause == "lost"
    assert "attempt 7.0 wrote no end: closed at" in render_text(later) and "(last heartbeat) as lost" in render_text(
        later
    )


def test_a_run_whose_heartbeats_are_fresh_is_still_running(tmp_path: Path) -> None:
    d = collect(_dead_run(tmp_path), now=1040.0)  # beat 7 s old < 5 x failure.heartbeat_s(2) + 5
    assert d.running and d.goodput.end == 1040.0 and d.goodput.closed == {}


def test_a_dead_run_is_closed_at_slurms_end_when_sacct_knows_it(tmp_path: Path) -> None:
    ts = datetime.fromtimestamp  # sacct prints local time
    recs = [
        {
            "JobID": "7",
            "State": "NODE_FAIL",
            "Submit": ts(990).isoformat(),
            "Start": ts(1000).isoformat(),
            "End": ts(1036).isoformat(),
        }
    ]
    d = collect(_dead_run(tmp_path), now=100_000.0, sacct_records=recs)
    g = d.goodput
    assert not d.running and (g.start, g.end) == (990.0, 1036.0)
    assert g.allocated_s == pytest.approx(36.0) and g.goodput == pytest.approx(8.0 / 36.0)
    assert g.closed["7.0"].by == "Slurm End (NODE_FAIL)" and g.failures == 1
    # a job Slurm still runs is running, whatever its heartbeats say
    recs[0].update(State="RUNNING", End="Unknown")
    (tmp_path / "b").mkdir()
    assert collect(_dead_run(tmp_path / "b"), now=100_000.0, sacct_records=recs).running


def test_the_active_states_are_slurm_states() -> None:
    assert goodput._ACTIVE == slurm_state.ACTIVE_STATES


def test_a_rollbacks_discarded_steps_are_lost_work_and_the_steps_trained_again_productive() -> None:
    """log_every=4: steps 1-6 trained, a spike at step 7 rolls back to the checkpoint of step 4 (reload 1 s),
    steps 5-8 trained again; the first 5 and 6 were discarded."""
    events = [
        _ev(0, "attempt_start", "a"),
        _ev(10, "train_start", "a", step=0),
        _ev(18.0, "checkpoint_saved", "a", step=4, blocking_s=0.0, total_s=0.0),
        _ev(24.5, "rollback", "a", record={"to_step": 4}),
        _ev(27, "train_end", "a", step=8),
        _ev(28, "attempt_end", "a", cause="completed", action="done", step=8),
    ]
    first = _steps(1, 6, t0=10)  # ends 12 .. 22; the spike step 7 (22 -> 24) is not recorded
    again = _steps(5, 8, t0=25, dt=0.5)  # reloaded at 25: ends 25.5 .. 27
    metrics = [_row("a", first[:4]), _row("a", first[4:] + again[:2]), _row("a", again[2:])]
    g = measure_goodput(events, metrics, now=100.0)
    assert (g.steps_productive, g.steps_lost) == (8, 2)
    assert g.seconds["productive"] == pytest.approx(4 * 2.0 + 4 * 0.5)
    assert g.seconds["lost_work"] == pytest.approx(2 * 2.0)  # steps 5, 6 of the abandoned timeline
    assert g.seconds["other"] == pytest.approx(3.0 + 1.0)  # the spike step + reload 22 -> 25; 27 -> 28
    assert g.failures == 0


def test_a_save_inside_a_log_interval_is_a_stall_not_part_of_the_steps() -> None:
    """log_every=4: steps 1-4 of 1 s each, a 3 s blocking save after step 2 (checkpoint.every_steps=2)."""
    trained = [(1, 11.0, 1.0), (2, 12.0, 1.0), (3, 16.0, 1.0), (4, 17.0, 1.0)]
    events = [
        _ev(0, "attempt_start", "a"),
        _ev(10, "train_start", "a", step=0),
        _ev(15.0, "checkpoint_saved", "a", step=2, blocking_s=3.0, total_s=3.0),
        _ev(17.5, "attempt_end", "a", cause="completed", action="done", step=4),
    ]
    g = measure_goodput(events, [_row("a", trained)], now=100.0)
    assert g.seconds["productive"] == pytest.approx(4.0) and g.seconds["checkpoint_stall"] == pytest.approx(3.0)
    assert g.seconds["other"] == pytest.approx(0.5) and g.seconds["startup"] == pytest.approx(10.0)
    stall = next(s for s in g.segments if s.kind == "checkpoint_stall")
    assert (stall.start, stall.end, stall.step) == (12.0, 15.0, 2)


def test_failure_detection_runs_from_the_last_step_to_the_decision_and_mttr_from_the_last_step() -> None:
    """Attempt a: steps 1-3 end at 13; a rank hangs; the watchdog's decision comes at 43; teardown to 45.
    Attempt b starts at 50 and trains its first step from 58."""
    events = [
        _ev(0, "attempt_start", "a"),
        _ev(10, "train_start", "a", step=0),
        _ev(42, "failure", "a", cls="hung_rank", suspects=[]),
        _ev(43, "decision", "a", action="restart"),
        _ev(45, "attempt_end", "a", cause="hung_rank", action="restart", step=3),
        _ev(50, "attempt_start", "b"),
        _ev(58, "train_start", "b", step=0),
        _ev(64, "attempt_end", "b", cause="completed", action="done", step=3),
    ]
    metrics = [_row("a", _steps(1, 3, t0=7, dt=2.0)), _row("b", _steps(1, 3, t0=58, dt=2.0))]
    g = measure_goodput(events, metrics, now=100.0)
    assert g.seconds["failure_detection"] == pytest.approx(43.0 - 13.0)
    assert g.mttr_s == pytest.approx(58.0 - 13.0)  # last progress -> the next step's start
    assert g.seconds["other"] == pytest.approx(2.0)  # decision -> end of attempt a


def test_the_expected_goodput_counts_the_startup_and_the_saves() -> None:
    # No failures in sight (MTBF 1e12 s): Daly's wall time is the solve time plus one save per interval,
    # 100 s of work with a 1 s save every 10 s = 110 s; plus a 20 s start-up.
    got = expected_goodput(solve_s=100.0, interval_s=10.0, blocking_s=1.0, mtbf_s=1e12, restart_s=20.0, startup_s=20.0)
    assert got == pytest.approx(100.0 / 130.0, rel=1e-6)
    assert expected_goodput(
        solve_s=100.0, interval_s=10.0, blocking_s=1.0, mtbf_s=1e12, restart_s=0, startup_s=0
    ) == pytest.approx(100 / 110, rel=1e-6)


def test_status_names_an_attempt_that_died_without_an_end(tmp_path: Path, monkeypatch) -> None:
    import jobs.status

    monkeypatch.setattr(jobs.status, "sacct_attempts", lambda job: [])  # accounting knows nothing of job 7
    text = jobs.status.status_text(_dead_run(tmp_path))
    assert "attempt 7.0 is not running although it wrote no end: it died at " in text and "(last heartbeat)" in text


def test_a_requeued_attempt_takes_its_own_sacct_record_and_the_expected_figure_uses_the_productive_time(
    tmp_path: Path,
) -> None:
    from jobs.failure.ledger import attempts
    from jobs.telemetry.run_report import slurm_ends

    ts = datetime.fromtimestamp
    recs = [
        {"JobID": "7", "State": "REQUEUED", "End": ts(1050).isoformat()},
        {"JobID": "7", "State": "FAILED", "End": ts(1090).isoformat()},
        {"JobID": "8", "State": "RUNNING", "End": "Unknown"},
    ]
    rows = attempts(
        [
            _ev(1000, "attempt_start", "7.0", job_id="7"),
            _ev(1060, "attempt_start", "7.1", job_id="7"),
            _ev(1070, "attempt_start", "8.0", job_id="8"),
        ]
    )
    assert slurm_ends(rows, recs) == {"7.0": ("REQUEUED", 1050.0), "7.1": ("FAILED", 1090.0), "8.0": ("RUNNING", None)}
    costs = {"interval_s": 10.0, "blocking_s": 1.0, "mtbf_s": 1e12, "restart_s": 13.0, "startup_s": 13.0}
    d = collect(_dead_run(tmp_path), now=100_000.0, costs=costs)
    # 8 s of productive steps (1-4, the rest died uncommitted): 8 s + 0.8 saves of 1 s + one 13 s start-up = 21.8 s
    assert d.goodput.expected == pytest.approx(8.0 / 21.8, rel=1e-6)


def test_steps_after_a_dead_attempts_last_checkpoint_are_lost_and_a_requeue_reclassifies_nothing(
    tmp_path: Path,
) -> None:
    """Saved at step 4, died after step 10. Productive 4 steps (8 s), not 10 (0.606); the requeue
    that resumes from step 4 and trains 5-10 again leaves attempt 7.0's figures as they were before it came."""
    run = _dead_run(tmp_path)
    alone = collect(run, now=100_000.0).goodput
    assert (alone.steps_productive, alone.steps_lost) == (4, 6)
    assert alone.seconds["productive"] == pytest.approx(8.0) and alone.goodput == pytest.approx(8.0 / 33.0)
    # attempt 7.1 starts at 1050, loads step 4, trains 5-10 (1 s each) from 1060, completes at 1067
    with (run / "events.jsonl").open("a") as f:
        for e in (
            _ev(1050, "attempt_start", "7.1", job_id="7"),
            _ev(1059, "checkpoint_loaded", "7.1", step=4),
            _ev(1060, "train_start", "7.1", step=4),
            _ev(1066.5, "checkpoint_saved", "7.1", step=10, blocking_s=0.0, total_s=0.5),
            _ev(1067, "attempt_end", "7.1", cause="completed", action="done", step=10),
        ):
            f.write(json.dumps(e) + "\n")
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(_row("7.1", _steps(5, 10, t0=1060, dt=1.0))) + "\n")
    both = collect(run, now=100_000.0).goodput
    first = [s for s in both.segments if s.attempt == "7.0"]
    assert sum(s.end - s.start for s in first if s.kind == "productive") == pytest.approx(8.0)
    assert sum(s.end - s.start for s in first if s.kind == "lost_work") == pytest.approx(12.0)
    assert (both.steps_productive, both.steps_lost) == (10, 6)
    assert both.seconds["productive"] == pytest.approx(8.0 + 6.0)


def test_a_running_attempts_steps_since_its_last_save_count_until_it_ends() -> None:
    """A running attempt may still save what it trained: its steps are productive while it runs; a completed one
    keeps every step (its work is the run's result)."""
    events = [_ev(0, "attempt_start", "a"), _ev(10, "train_start", "a", step=0)]
    metrics = [_row("a", _steps(1, 5, t0=10))]
    assert measure_goodput(events, metrics, now=30.0).steps_productive == 5
    done = [*events, _ev(21, "attempt_end", "a", cause="completed", action="done", step=5)]
    assert measure_goodput(done, metrics, now=30.0).steps_productive == 5
    died = [*events, _ev(21, "attempt_end", "a", cause="dead_rank", action="none", step=5)]
    assert (
        measure_goodput(died, metrics, now=30.0).steps_productive,
        measure_goodput(died, metrics, now=30.0).steps_lost,
    ) == (0, 5)
