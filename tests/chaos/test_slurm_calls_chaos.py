"""Slurm calls that fail, from outside, on the real local cluster: slurmctld SIGSTOPped past MessageTimeout (5 s,
scripts/slurm/start) while a restart's srun starts and while the requeue after it is asked for (the restart becomes a
requeue, the requeue is tried again, the run finishes bitwise); and per-task exit codes: a rank killed by a signal
while its peer is stopped, so that no rank decides, ends the job with the supervisor's "do not requeue" 76, not the
137 that srun returns."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.chaos.chaos_helpers import (
    DONE_S,
    SHORT_FAULT_STEP,
    SHORT_HANG_S,
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

# Bounds of the waits while slurmctld is stopped. Every Slurm call then waits MessageTimeout (5 s; `scontrol show
# job` tries twice: 10 s): the decider's restart published -> the supervisor's time-limit check (10 s) -> its srun
# gives up (5 s) -> its decision asks `scontrol show job` (10 s) -> `scontrol requeue` gives up (5 s) -> tried again.
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
        # Then its decision path asks `scontrol show job` (10 s) and `scontrol requeue` (5 s): let slurmctld go once
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


@pytest.mark.timeout(bound_s(STEP_S, DONE_S))
def test_a_rank_killed_by_a_bus_error_while_its_peer_is_stopped_ends_the_job_76_not_srun_s_137(run_root: Path) -> None:
    # Rank 0 SIGSTOPped (no decider: its watchdog is stopped with it), then rank 1 killed by SIGBUS (srun: "task 1:
    # Bus error"). The supervisor's no-decision bound (failure.hang_timeout_s, SHORT_HANG_S) starts from rank 1's
    # death (before: srun's line for a bus error, an FPE, "User defined signal 2" or an OOM started no bound, and the
    # job waited for the time limit); it kills the step (rank 0: 137) and decides in the ranks' place with no budget
    # left: stop, 76. srun returns the highest task code (137); the job must end with 76, "do not requeue".
    job = submit(
        run_root,
        "failure.restarts_in_allocation=0",
        "failure.max_requeues=0",
        f"failure.hang_timeout_s={SHORT_HANG_S}",
        steps=SHORT_STEPS,
    )
    wait_for_step(run_root, 5)
    os.kill(rank_pid(run_root, f"{job}.0", 0), signal.SIGSTOP)
    os.kill(rank_pid(run_root, f"{job}.0", 1), signal.SIGBUS)
    recs = wait_job_done(job)
    assert [(r["State"].split()[0], r["ExitCode"]) for r in recs] == [("FAILED", "76:0")], recs
    (d,) = events(run_root, "decision")
    assert (d["attempt"], d["rank"], d["cause"], d["action"], d["exit_code"]) == (
        f"{job}.0",
        -1,
        "dead_rank",
        "stop",
        76,
    )
    (f,) = events(run_root, "failure")
    assert (f["rank"], f["cls"]) == (-1, "dead_rank") and "task 1" in f["summary"], f
    evidence = json.loads((run_root / "incidents" / f"{job}.0" / "incident.json").read_text())["evidence"]
    assert evidence["task_exit_codes"] == {"0": 137, "1": 128 + signal.SIGBUS}, evidence  # 0: the step's kill
    log = _job_log(run_root, job)
    assert "task 1: Bus error" in log and "task 0: Killed" in log, log[-3000:]
