"""Slurm calls that fail once do not end the job: `scontrol requeue` is tried again while slurmctld
does not answer, a step srun cannot create is requeued instead of ending FAILED, and `squeue` is bounded."""

from __future__ import annotations

import stat
import sys
import time
from pathlib import Path

from jobs import exitcodes
from jobs.events import read_events
from jobs.failure import policy, quarantine
from jobs.launch import supervise
from tests.unit.test_requeue_path import _ctx, _job, _verbs, slurm  # noqa: F401 - slurm: the stand-in fixture
from tests.unit.test_supervisor_decides import _cfg, run_dir  # noqa: F401 - run_dir: a fixture


def test_a_requeue_that_slurmctld_times_out_is_tried_again(slurm: Path, monkeypatch) -> None:
    # Before: one `scontrol requeue`; its "Socket timed out" left the job to end with exit 75, not requeued.
    monkeypatch.setattr(quarantine, "_RETRY_PAUSES_S", (0.01, 0.01, 0.01))
    _job(slurm, requeue_fails=2)
    ok, said = policy.requeue_job("9")
    assert ok and _job(slurm)["restarts"] == 1, said
    assert _verbs(slurm) == ["scontrol requeue"] * 3
    assert said.count("Socket timed out on send/recv operation") == 2 and said.endswith("scontrol requeue: rc 0")


def test_a_requeue_slurmctld_carried_out_after_scontrol_gave_up_waiting_is_tried_again_and_counts_as_done(
    slurm: Path, monkeypatch
) -> None:
    # What 22.05.8 does with slurmctld SIGSTOPped past MessageTimeout (tests/chaos/test_slurm_calls_chaos.py): `scontrol
    # requeue` exits 1 "Unexpected message received for job N", and slurmctld requeues the job once it runs again;
    # the next try is refused "Job is pending execution". Before: not taken for slurmctld's silence, never tried
    # again, and the requeue recorded as failed (a request slurmctld then lost would have ended the job FAILED, 75).
    monkeypatch.setattr(quarantine, "_RETRY_PAUSES_S", (0.01, 0.01, 0.01))
    _job(slurm, requeue_unanswered=1)
    ok, said = policy.requeue_job("9")
    assert ok and _job(slurm)["restarts"] == 1 and _verbs(slurm) == ["scontrol requeue"] * 2, said
    assert said == (
        "scontrol requeue: rc 1 Unexpected message received for job 9; "
        "scontrol requeue: rc 1 Job is pending execution for job 9; "
        "an earlier try reached slurmctld: the job is requeued"
    )


def test_a_requeue_refused_as_pending_without_an_unanswered_try_before_is_not_taken_for_done(slurm: Path) -> None:
    _job(slurm, state="PENDING")
    ok, said = policy.requeue_job("9")
    assert not ok and said == "scontrol requeue: rc 1 Job is pending execution for job 9"


def test_a_slurmctld_that_never_answers_is_given_up_after_four_tries_and_a_refusal_at_once(
    slurm: Path, monkeypatch
) -> None:
    monkeypatch.setattr(quarantine, "_RETRY_PAUSES_S", (0.01, 0.01, 0.01))
    _job(slurm, requeue_fails=9)
    ok, _ = policy.requeue_job("9")
    assert not ok and _verbs(slurm) == ["scontrol requeue"] * 4 and _job(slurm)["restarts"] == 0
    ok, said = quarantine.scontrol(["update", "JobId=9", "ExcNodeList=node1"])  # RUNNING: refused, not transient
    assert not ok and "Job is no longer pending execution" in said and _verbs(slurm).count("scontrol update") == 1


def test_the_decider_requeues_through_a_busy_slurmctld(tmp_path: Path, slurm: Path, monkeypatch) -> None:
    monkeypatch.setattr(quarantine, "_RETRY_PAUSES_S", (0.01, 0.01, 0.01))
    _job(slurm, requeue_fails=1)
    from jobs.failure.respond import conclude

    assert conclude(_ctx(tmp_path), cause="SIGUSR2", step=12) == exitcodes.REQUEUE
    (rq,) = read_events(tmp_path / "events.jsonl", "requeue")
    assert rq["ok"] is True and _job(slurm)["restarts"] == 1


# The ranks' step, twice: the first time its decider decides "restart" (as in test_spares); the second time srun
# cannot create the step (slurmctld busy, or a node lost in between).
_SRUN = """#!{python}
import json, os, sys
d = os.environ["FAKE_SLURM"]
os.makedirs(os.path.join(d, "steps"), exist_ok=True)
n = len(os.listdir(os.path.join(d, "steps")))
open(os.path.join(d, "steps", str(n)), "w").close()
if n == 0:
    run = os.environ["RUN"]
    os.makedirs(run + "/incidents/9.0", exist_ok=True)
    json.dump({{"action": "restart", "reason": "x", "exit_code": 75}}, open(run + "/incidents/9.0/decision.json", "w"))
    sys.exit(75)
print("srun: error: Unable to create step for job 9: Socket timed out on send/recv operation", file=sys.stderr)
sys.exit(1)
"""


def test_a_restart_whose_step_srun_cannot_create_is_requeued_not_failed(
    run_dir: Path,  # noqa: F811 - the fixture imported above
    slurm: Path,  # noqa: F811
    monkeypatch,
) -> None:
    # Before: the second srun exited 1 without a decision, the supervisor returned 1 and the job ended FAILED.
    (slurm / "srun").write_text(_SRUN.format(python=sys.executable))
    (slurm / "srun").chmod((slurm / "srun").stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("RUN", str(run_dir))
    run_dir.mkdir(parents=True)
    assert supervise.supervise(_cfg(run_dir), logs=("o", "e")) == exitcodes.REQUEUE
    (d,) = read_events(run_dir / "events.jsonl", "decision")
    assert (d["attempt"], d["cause"], d["action"]) == ("9.0.1", "step_launch_failure", "requeue"), d
    (f,) = [e for e in read_events(run_dir / "events.jsonl", "failure") if e["cls"] == "step_launch_failure"]
    assert f["summary"].startswith("srun exited 1 before any rank ran (srun: error: Unable to create step"), f
    assert _job(slurm)["restarts"] == 1


def test_squeue_is_bounded_and_tried_again(slurm: Path, monkeypatch) -> None:
    # Before: `squeue` without a timeout: a hung slurmctld held the supervisor's kill (and the guard) forever.
    (slurm / "squeue").write_text("#!/bin/sh\nexec sleep 5\n")
    (slurm / "squeue").chmod(0o755)
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    monkeypatch.setattr(supervise, "_SQUEUE_S", 0.3)
    t0 = time.monotonic()
    assert supervise._numbered_steps(tries=2) == []
    assert time.monotonic() - t0 < 3.5
