"""The chaos tier's wait for sacct's records (tests/chaos/chaos_helpers._accounted), on canned sacct answers: a job
resized by Slurm (a failed node taken out of a --no-kill job, the spare swap) is final at once, a requeued job's
record is not its end, and a record that never turns final fails the wait, named, instead of costing it silently."""

from __future__ import annotations

import time

import pytest

from tests.chaos import chaos_helpers


def _sacct_answering(monkeypatch, *answers: list[str]) -> None:
    """sacct answers each call with the next list of states (the last one from then on)."""
    left = list(answers)

    def fake(job: str) -> list[dict[str, str]]:
        states = left.pop(0) if len(left) > 1 else left[0]
        return [{"JobID": job, "State": s} for s in states]

    monkeypatch.setattr(chaos_helpers, "sacct", fake)


def test_a_resized_then_completed_job_is_accounted_at_once(monkeypatch) -> None:
    _sacct_answering(monkeypatch, ["RESIZING", "COMPLETED"])
    t0 = time.monotonic()
    recs = chaos_helpers._accounted("7", wait_s=5)
    assert [r["State"] for r in recs] == ["RESIZING", "COMPLETED"] and time.monotonic() - t0 < 1


def test_records_that_turn_final_late_are_waited_for(monkeypatch) -> None:
    _sacct_answering(monkeypatch, [], ["REQUEUED", "RUNNING"], ["REQUEUED", "COMPLETED"])
    assert [r["State"] for r in chaos_helpers._accounted("7", wait_s=5)] == ["REQUEUED", "COMPLETED"]


def test_a_record_that_never_turns_final_fails_the_wait_naming_it(monkeypatch) -> None:
    _sacct_answering(monkeypatch, ["REQUEUED", "SOMETHING_NEW"])
    with pytest.raises(AssertionError, match="not final after 0.3 s.*SOMETHING_NEW"):
        chaos_helpers._accounted("7", wait_s=0.3)


def test_a_requeued_record_alone_waits_for_the_allocation_after_it(monkeypatch) -> None:
    # CI: a requeued job had completed and left the queue, and sacct still showed only its first allocation's
    # REQUEUED record; the wait returned it and the test read REQUEUED as the job's end
    _sacct_answering(monkeypatch, ["REQUEUED"], ["REQUEUED"], ["REQUEUED", "COMPLETED"])
    assert [r["State"] for r in chaos_helpers._accounted("7", wait_s=5)] == ["REQUEUED", "COMPLETED"]
