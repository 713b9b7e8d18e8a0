"""Goodput from a hand-written ledger: every loss bucket, MTBF and MTTR equal the figures worked out by hand."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jobs.telemetry.goodput import KINDS, is_failure, measure_goodput
from tests.conftest import REPO


def _ev(t: float, kind: str, attempt: str, **fields) -> dict:
    return {"time": t, "kind": kind, "rank": 0, "attempt": attempt, **fields}


def _steps(attempt: str, first: int, ends: list[float], dt: float = 2.0) -> list[dict]:
    return [
        {"step": first + i, "loss": 5.0, "step_time_s": dt, "attempt": attempt, "time": t} for i, t in enumerate(ends)
    ]


def _two_attempts_one_failure() -> tuple[list[dict], list[dict]]:
    """Attempt local.0: start 1000, trains steps 1-6 from 1010 (2 s each, a 1 s stall after the save of
    step 4), dies (dead_rank) at 1030. Attempt local.0.1: start 1040, resumes from step 4 at 1050,
    trains 5-8, saves 8 (0.5 s stall), ends 1060."""
    events = [
        _ev(1000, "attempt_start", "local.0", nodes=["n1"]),
        _ev(1002, "rendezvous", "local.0"),
        _ev(1010, "train_start", "local.0", step=0),
        _ev(1012, "first_step", "local.0", step=1, step_time_s=2.0),
        _ev(1021, "checkpoint_saved", "local.0", step=4, blocking_s=1.0, total_s=3.0),
        _ev(1029, "failure", "local.0", cls="dead_rank", suspects=[]),
        _ev(1030, "attempt_end", "local.0", cause="dead_rank", action="restart", step=6),
        _ev(1040, "attempt_start", "local.0.1", nodes=["n1"]),
        _ev(1049, "checkpoint_loaded", "local.0.1", step=4),
        _ev(1050, "train_start", "local.0.1", step=4),
        _ev(1052, "first_step", "local.0.1", step=5, step_time_s=2.0),
        _ev(1059.5, "checkpoint_saved", "local.0.1", step=8, blocking_s=0.5, total_s=1.5),
        _ev(1059.9, "train_end", "local.0.1", step=8),
        _ev(1060, "attempt_end", "local.0.1", cause="completed", action="done", step=8),
    ]
    metrics = _steps("local.0", 1, [1012, 1014, 1016, 1018, 1021, 1023]) + _steps(
        "local.0.1", 5, [1052, 1054, 1056, 1058]
    )
    return events, metrics


def test_goodput_of_two_attempts_with_one_failure_equals_the_hand_computed_figure() -> None:
    events, metrics = _two_attempts_one_failure()
    g = measure_goodput(events, metrics, now=2000.0, queue=[(990.0, 1000.0)], expected=0.9)
    # By hand: wall 990 -> 1060 = 70 s. productive: steps 1-4 (local.0) + 5-8 (local.0.1) = 8 x 2 s.
    # lost: steps 5, 6 of local.0 (redone) = 4 s. startup: 1000->1010 + 1040->1050 = 20 s.
    # stalls 1 + 0.5. restart gap 1030->1040 = 10. queue 990->1000 = 10.
    # failure detection: local.0's last progress (step 6 ends at 1023) -> its end 1030 (no decision) = 7.
    # other: 1058.5->1060 (after the last save of local.0.1) = 1.5.
    assert g.wall_s == 70.0
    assert g.seconds == pytest.approx(
        {
            "productive": 16.0,
            "startup": 20.0,
            "checkpoint_stall": 1.5,
            "lost_work": 4.0,
            "failure_detection": 7.0,
            "restart_gap": 10.0,
            "queue_wait": 10.0,
            "other": 1.5,
        }
    )
    assert g.goodput == pytest.approx(16.0 / 60.0)  # productive / allocated (wall less the queue)
    assert g.wall_goodput == pytest.approx(16.0 / 70.0)
    assert (g.steps_productive, g.steps_lost) == (8, 2)
    assert g.allocated_s == 60.0 and g.attempts_s == 50.0 and g.failures == 1
    assert g.mtbf_s == pytest.approx(50.0)  # 50 s inside attempts / 1 failure
    assert g.mttr_s == pytest.approx(27.0)  # last progress at 1023 -> training again at 1050
    assert g.expected == 0.9


def test_the_segments_tile_the_wall_time_without_overlap() -> None:
    events, metrics = _two_attempts_one_failure()
    g = measure_goodput(events, metrics, now=2000.0, queue=[(990.0, 1000.0)])
    assert g.segments[0].start == g.start and g.segments[-1].end == g.end
    assert all(a.end == b.start for a, b in zip(g.segments, g.segments[1:]))
    assert {s.kind for s in g.segments} == set(KINDS)


def test_a_lost_attempt_ends_at_its_own_last_record_and_the_wait_is_a_restart_gap() -> None:
    events, metrics = _two_attempts_one_failure()
    # local.0 was killed whole: no failure/attempt_end of its own; the next attempt closes it as lost.
    events = [e for e in events if not (e["attempt"] == "local.0" and e["kind"] in ("failure", "attempt_end"))]
    events.insert(6, _ev(1040, "failure", "local.0", cls="lost", suspects=[]))
    events.insert(7, _ev(1040, "attempt_end", "local.0", cause="lost", action="none", step=6))
    g = measure_goodput(events, metrics, now=2000.0)
    assert g.seconds["restart_gap"] == pytest.approx(1040 - 1023)  # its last step logged at 1023
    assert g.seconds["other"] == pytest.approx(1.5) and g.seconds["failure_detection"] == 0.0
    assert g.failures == 1 and g.mttr_s == pytest.approx(1050 - 1023)


def test_a_running_attempt_ends_now_and_a_row_stands_for_the_steps_since_the_previous_one() -> None:
    events = [_ev(0, "attempt_start", "1.0"), _ev(4, "train_start", "1.0", step=0)]
    metrics = _steps("1.0", 5, [14.0], dt=2.0)  # log_every=5: step 5 at 14 stands for steps 1-5, 2 s each
    g = measure_goodput(events, metrics, now=20.0)
    assert (g.start, g.end, g.steps_productive) == (0.0, 20.0, 5)
    assert g.seconds["productive"] == pytest.approx(10.0) and g.seconds["startup"] == pytest.approx(4.0)
    assert g.seconds["other"] == pytest.approx(6.0) and g.failures == 0 and g.mtbf_s is None


def test_only_machine_failures_count_for_mtbf() -> None:
    from checkpoint.interval import NOT_FAILURES  # the interval's own list of deliberate stops
    from jobs.telemetry import goodput

    assert goodput.NOT_FAILURES == NOT_FAILURES
    assert [is_failure(c) for c in ("dead_rank", "lost", "hung_rank", "completed", "SIGUSR2", "preempted", None)] == [
        True,
        True,
        True,
        False,
        False,
        False,
        False,
    ]


def test_goodput_imports_no_torch() -> None:
    code = "import sys, jobs.telemetry.goodput; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
