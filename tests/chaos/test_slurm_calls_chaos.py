"""Slurm calls that fail, from outside, on the real local cluster: slurmctld SIGSTOPped past MessageTimeout (10 s,
scripts/slurm/start) while a restart's srun starts and while the requeue after it is asked for (the restart becomes a
requeue, the requeue is tried again, the run finishes bitwise)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.chaos.chaos_helpers import (
    DONE_S,
    SHORT_FAULT_STEP,
    SHORT_STEPS,
    SLURM_RUN,
    STEP_S,
    assert_bitwise_equal_to_reference,
    bound_s,
    events,
    rank_pid,
    submit,
    wait_for_step,
    wait_job_done,
)
from tests.slurm.slurm_helpers import scontrol_job

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]

# Bounds of the waits while slurmctld is stopped. Every Slurm call then waits MessageTimeout (10 s; `scontrol show
# job` tries twice: 20 s): the decider's restart published -> the supervisor's time-limit check (20 s) -> its srun
# gives up (10 s) -> its decision asks `scontrol show job` (20 s) -> `scontrol requeue` gives up (10 s) -> tried again.
STOPPED_S = 120


def _wait_for(what: Callable[[], bool], timeout: float, said: str) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, f"{said} within {timeout} s"
        time.sleep(0.01)


def _job_log(run_root: Path, job: str) -> str:
    return "".join(p.read_text(errors="replace") for p in (run_root / "slurm" / job).glob("*_log.*"))


def _retried(run_root: Path, job: str) -> bool:
    """Whether the job log says that a `scontrol requeue` slurmctld did not answer is tried again."""
    return f"scontrol requeue: rc 1 Unexpected message received for job {job}; trying again in" in _job_log(
        run_root, job
    )


def _failure_of(run_root: Path, attempt: str) -> bool:
    return any(e["attempt"] == attempt for e in events(run_root, "failure"))


@pytest.mark.timeout(bound_s(STEP_S, 120, STOPPED_S, DONE_S))  # its own waits are the bound
def test_a_stalled_slurmctld_fails_the_restarts_srun_and_its_requeue_once_yet_the_run_requeues_and_finishes_bitwise(
    run_root: Path, short_reference, tmp_path
) -> None:
    # kill -9 of rank 1: its decider (rank 0) decides a restart inside the allocation. The moment that decision is
    # published, slurmctld is SIGSTOPped (busy, swapping, failing over) and held stopped through what follows:
    # 1. the supervisor's srun for the restart gives up after MessageTimeout ("Unable to confirm allocation ...:
    #    Socket timed out"): no rank ran. Before: the supervisor returned srun's 1 and the job ended FAILED. Now a
    #    `step_launch_failure`, requeued.
    # 2. its `scontrol requeue` gives up too ("Unexpected message received for job N", rc 1), and slurmctld carries
    #    it out once it runs again. Before: taken for a refusal, never tried again, recorded ok=false. Now tried
    #    again (slurmctld is let go once the log says so) and found done.
    job = submit(run_root, steps=SHORT_STEPS)
    wait_for_step(run_root, SHORT_FAULT_STEP)
    os.kill(rank_pid(run_root, f"{job}.0", 1), signal.SIGKILL)
    _wait_for((run_root / "incidents" / f"{job}.0" / "decision.json").exists, 120, "no decision of the kill")
    ctld = int((SLURM_RUN / "slurmctld.pid").read_text())
    os.kill(ctld, signal.SIGSTOP)
    try:
        _wait_for(lambda: _failure_of(run_root, f"{job}.0.1"), STOPPED_S, "the restart's srun did not fail")
        # Then its decision path asks `scontrol show job` (20 s) and `scontrol requeue` (10 s): let slurmctld go once
        # the requeue is tried again (before: recorded as failed at the first try, while slurmctld was still stopped).
        _wait_for(lambda: _retried(run_root, job) or bool(events(run_root, "requeue")), 60, "no requeue asked for")
    finally:
        os.kill(ctld, signal.SIGCONT)
    recs = wait_job_done(job)
    assert [r["State"].split()[0] for r in recs] == ["REQUEUED", "COMPLETED"], recs
    info = scontrol_job(job)
    assert (info["Restarts"], info["ExcNodeList"]) == ("1", "(null)"), info
    decisions = [(e["attempt"], e["cause"], e["action"]) for e in events(run_root, "decision")]
    assert decisions == [(f"{job}.0", "dead_rank", "restart"), (f"{job}.0.1", "step_launch_failure", "requeue")]
    (launch,) = [e for e in events(run_root, "failure") if e["attempt"] == f"{job}.0.1"]
    assert "srun exited 1 before any rank ran" in launch["summary"] and "Socket timed out" in launch["summary"]
    (rq,) = events(run_root, "requeue")
    assert (_retried(run_root, job), rq["ok"], rq["excluded"]) == (True, True, []), rq["scontrol"]
    assert rq["scontrol"].startswith(f"scontrol requeue: rc 1 Unexpected message received for job {job}; "), rq
    assert not (run_root / "quarantine.json").exists()
    assert [e["cause"] for e in events(run_root, "attempt_end")] == ["dead_rank", "step_launch_failure", "completed"]
    assert_bitwise_equal_to_reference(run_root, short_reference, tmp_path)
