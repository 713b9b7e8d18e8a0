"""The Slurm-side view of a job, pinned to what Slurm 22.05.8 printed on the local cluster (scripts/slurm/start)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from jobs import exitcodes
from jobs.launch import slurm_state
from jobs.launch.slurm_state import (
    SACCT_FIELDS,
    JobState,
    job_state,
    parse_sacct,
    parse_scontrol_job,
    sacct_attempts,
    wait_for_job,
)

# Real outputs, captured 2026-12-02 from job 1 (`sbatch --requeue --wrap 'sleep 60'`, then `scontrol requeue 1`
# once it ran, then `scancel 1` after its rerun started) and job 4.

# `scontrol -o show job 1` of `sbatch --requeue --wrap 'sleep 60'`, 4 s after it started.
SCONTROL_RUNNING = (
    "JobId=1 JobName=wrap UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901759 Nice=0 "
    "Account=root QOS=normal JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 "
    "BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:04 TimeLimit=UNLIMITED TimeMin=N/A "
    "SubmitTime=2026-12-02T18:44:14 EligibleTime=2026-12-02T18:44:14 AccrueTime=2026-12-02T18:44:14 "
    "StartTime=2026-12-02T18:44:14 EndTime=Unknown Deadline=N/A PreemptEligibleTime=2026-12-02T18:44:14 "
    "PreemptTime=None SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-12-02T18:44:14 Scheduler=Main "
    "Partition=debug AllocNode:Sid=localhost:3121 ReqNodeList=(null) ExcNodeList=(null) NodeList=node1 "
    "BatchHost=node1 NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:* "
    "TRES=cpu=1,mem=512M,node=1,billing=1 Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=* MinCPUsNode=1 "
    "MinMemoryCPU=512M MinTmpDiskNode=0 Features=(null) DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 "
    "Licenses=(null) Network=(null) Command=(null) WorkDir=/tmp/ssc StdErr=/tmp/ssc/1.out "
    "StdIn=/dev/null StdOut=/tmp/ssc/1.out Power= \n"
)

# the same, 1 s after `scontrol requeue 1`: held for cred_expire+1 s (Reason=BeginTime), Restarts=1.
SCONTROL_PENDING_AFTER_REQUEUE = (
    "JobId=1 JobName=wrap UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901759 Nice=0 "
    "Account=root QOS=normal JobState=PENDING Reason=BeginTime Dependency=(null) Requeue=1 Restarts=1 "
    "BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:00 TimeLimit=UNLIMITED TimeMin=N/A "
    "SubmitTime=2026-12-02T18:44:20 EligibleTime=2026-12-02T18:44:31 AccrueTime=2026-12-02T18:44:31 "
    "StartTime=2026-12-02T18:44:31 EndTime=Unknown Deadline=N/A SuspendTime=None SecsPreSuspend=0 "
    "LastSchedEval=2026-12-02T18:44:14 Scheduler=Main Partition=debug AllocNode:Sid=localhost:3121 "
    "ReqNodeList=(null) ExcNodeList=(null) NodeList= NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 "
    "ReqB:S:C:T=0:0:*:* TRES=cpu=1,mem=512M,node=1,billing=1 Socks/Node=* NtasksPerN:B:S:C=0:0:*:* "
    "CoreSpec=* MinCPUsNode=1 MinMemoryCPU=512M MinTmpDiskNode=0 Features=(null) DelayBoot=00:00:00 "
    "OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) Command=(null) WorkDir=/tmp/ssc "
    "StdErr=/tmp/ssc/1.out StdIn=/dev/null StdOut=/tmp/ssc/1.out Power= \n"
)

# the same after it ran again and `scancel 1` ended it.
SCONTROL_CANCELLED_AFTER_RESTART = (
    "JobId=1 JobName=wrap UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901759 Nice=0 "
    "Account=root QOS=normal JobState=CANCELLED Reason=None Dependency=(null) Requeue=1 Restarts=1 "
    "BatchFlag=1 Reboot=0 ExitCode=0:15 RunTime=00:00:08 TimeLimit=UNLIMITED TimeMin=N/A "
    "SubmitTime=2026-12-02T18:44:20 EligibleTime=2026-12-02T18:44:31 AccrueTime=2026-12-02T18:44:31 "
    "StartTime=2026-12-02T18:44:32 EndTime=2026-12-02T18:44:40 Deadline=N/A "
    "PreemptEligibleTime=2026-12-02T18:44:32 PreemptTime=None SuspendTime=None SecsPreSuspend=0 "
    "LastSchedEval=2026-12-02T18:44:32 Scheduler=Main Partition=debug AllocNode:Sid=localhost:3121 "
    "ReqNodeList=(null) ExcNodeList=(null) NodeList=node1 BatchHost=node1 NumNodes=1 NumCPUs=1 "
    "NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=1,mem=512M,node=1,billing=1 Socks/Node=* "
    "NtasksPerN:B:S:C=0:0:*:* CoreSpec=* MinCPUsNode=1 MinMemoryCPU=512M MinTmpDiskNode=0 "
    "Features=(null) DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) "
    "Command=(null) WorkDir=/tmp/ssc StdErr=/tmp/ssc/1.out StdIn=/dev/null StdOut=/tmp/ssc/1.out Power= \n"
)

# the same record as `scontrol show job 1` prints it without -o.
SCONTROL_CANCELLED_AFTER_RESTART_INDENTED = (
    "JobId=1 JobName=wrap\n"
    "   UserId=root(0) GroupId=root(0) MCS_label=N/A\n"
    "   Priority=4294901759 Nice=0 Account=root QOS=normal\n"
    "   JobState=CANCELLED Reason=None Dependency=(null)\n"
    "   Requeue=1 Restarts=1 BatchFlag=1 Reboot=0 ExitCode=0:15\n"
    "   RunTime=00:00:08 TimeLimit=UNLIMITED TimeMin=N/A\n"
    "   SubmitTime=2026-12-02T18:44:20 EligibleTime=2026-12-02T18:44:31\n"
    "   AccrueTime=2026-12-02T18:44:31\n"
    "   StartTime=2026-12-02T18:44:32 EndTime=2026-12-02T18:44:40 Deadline=N/A\n"
    "   PreemptEligibleTime=2026-12-02T18:44:32 PreemptTime=None\n"
    "   SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-12-02T18:44:32 Scheduler=Main\n"
    "   Partition=debug AllocNode:Sid=localhost:3121\n"
    "   ReqNodeList=(null) ExcNodeList=(null)\n"
    "   NodeList=node1\n"
    "   BatchHost=node1\n"
    "   NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:*\n"
    "   TRES=cpu=1,mem=512M,node=1,billing=1\n"
    "   Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=*\n"
    "   MinCPUsNode=1 MinMemoryCPU=512M MinTmpDiskNode=0\n"
    "   Features=(null) DelayBoot=00:00:00\n"
    "   OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null)\n"
    "   Command=(null)\n"
    "   WorkDir=/tmp/ssc\n"
    "   StdErr=/tmp/ssc/1.out\n"
    "   StdIn=/dev/null\n"
    "   StdOut=/tmp/ssc/1.out\n"
    "   Power=\n"
    "   \n"
    "\n"
)

# `scontrol -o show job 4` of `sbatch -J 'my job' --wrap 'exit 3'`: a job name with a space.
SCONTROL_FAILED_NAMED = (
    "JobId=4 JobName=my job UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901756 Nice=0 "
    "Account=root QOS=normal JobState=FAILED Reason=NonZeroExitCode Dependency=(null) Requeue=1 "
    "Restarts=0 BatchFlag=1 Reboot=0 ExitCode=3:0 RunTime=00:00:00 TimeLimit=365-00:00:00 TimeMin=N/A "
    "SubmitTime=2026-12-02T18:45:47 EligibleTime=2026-12-02T18:45:47 AccrueTime=2026-12-02T18:45:47 "
    "StartTime=2026-12-02T18:45:48 EndTime=2026-12-02T18:45:48 Deadline=N/A "
    "PreemptEligibleTime=2026-12-02T18:45:48 PreemptTime=None SuspendTime=None SecsPreSuspend=0 "
    "LastSchedEval=2026-12-02T18:45:48 Scheduler=Backfill Partition=debug AllocNode:Sid=localhost:3121 "
    "ReqNodeList=(null) ExcNodeList=(null) NodeList=node1 BatchHost=node1 NumNodes=1 NumCPUs=1 "
    "NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=1,mem=512M,node=1,billing=1 Socks/Node=* "
    "NtasksPerN:B:S:C=0:0:*:* CoreSpec=* MinCPUsNode=1 MinMemoryCPU=512M MinTmpDiskNode=0 "
    "Features=(null) DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) "
    "Command=(null) WorkDir=/tmp/ssc StdErr=/tmp/ssc/4.out StdIn=/dev/null StdOut=/tmp/ssc/4.out Power= \n"
)


# `sacct -j 1 --duplicates -X -n -P -o JobID,State,ExitCode,NodeList,Start,End,Elapsed` at the same moments:
# one record per attempt. Without --duplicates sacct prints only the last one (SACCT_*_LAST_ONLY).
SACCT_RUNNING = "1|RUNNING|0:0|node1|2026-12-02T18:44:14|Unknown|00:00:06\n"
SACCT_PENDING_AFTER_REQUEUE = "1|REQUEUED|0:0|node1|2026-12-02T18:44:14|2026-12-02T18:44:20|00:00:06\n"
SACCT_RERUN = SACCT_PENDING_AFTER_REQUEUE + "1|RUNNING|0:0|node1|2026-12-02T18:44:32|Unknown|00:00:06\n"
SACCT_RERUN_LAST_ONLY = "1|RUNNING|0:0|node1|2026-12-02T18:44:32|Unknown|00:00:06\n"
SACCT_CANCELLED_AFTER_RESTART = (
    SACCT_PENDING_AFTER_REQUEUE + "1|CANCELLED by 0|0:0|node1|2026-12-02T18:44:32|2026-12-02T18:44:40|00:00:08\n"
)
SACCT_CANCELLED_LAST_ONLY = "1|CANCELLED by 0|0:0|node1|2026-12-02T18:44:32|2026-12-02T18:44:40|00:00:08\n"

# Not captured: this cluster preempts with PreemptMode=REQUEUE (a preempted job shows COMPLETING, then PENDING,
# and sacct keeps a PREEMPTED record), so no job ends PREEMPTED here. These are the real final records above
# with only the state word swapped, standing for a job a PreemptMode=CANCEL partition ended.
SCONTROL_PREEMPTED = SCONTROL_CANCELLED_AFTER_RESTART.replace("JobState=CANCELLED", "JobState=PREEMPTED")
SACCT_PREEMPTED = SACCT_CANCELLED_AFTER_RESTART.replace("CANCELLED by 0", "PREEMPTED")
# A state this code does not know (what a newer Slurm might add), on the real final record.
SCONTROL_NEW_STATE = SCONTROL_CANCELLED_AFTER_RESTART.replace("JobState=CANCELLED", "JobState=LAUNCH_FAILED")


@dataclass
class Poll:
    """What scontrol and sacct answer during one poll of the job; None: the command fails (unknown job)."""

    scontrol: str | None
    sacct: str = ""  # with --duplicates
    sacct_last_only: str = ""  # without --duplicates


def _serve(monkeypatch: pytest.MonkeyPatch, polls: list[Poll]) -> list[list[str]]:
    """Replaces the Slurm commands with `polls`, one per scontrol call; fails a wait that outlives them."""
    calls: list[list[str]] = []

    def run(cmd: list[str]) -> str | None:
        calls.append(cmd)
        n = sum(c[0] == "scontrol" for c in calls)
        if n > len(polls):
            raise AssertionError(f"wait_for_job still polling after {len(polls)} polls: the last state did not end it")
        if cmd[0] == "scontrol":
            return polls[n - 1].scontrol
        assert cmd[cmd.index("-o") + 1] == ",".join(SACCT_FIELDS)  # the literals above have these fields
        poll = polls[max(n, 1) - 1]
        return poll.sacct if "--duplicates" in cmd else poll.sacct_last_only

    monkeypatch.setattr(slurm_state, "_run", run)
    return calls


def test_scontrol_one_line_and_indented_records_give_the_same_62_fields() -> None:
    fields = parse_scontrol_job(SCONTROL_CANCELLED_AFTER_RESTART)
    assert parse_scontrol_job(SCONTROL_CANCELLED_AFTER_RESTART_INDENTED) == fields
    assert len(fields) == 62
    assert (fields["JobState"], fields["Restarts"], fields["ExitCode"]) == ("CANCELLED", "1", "0:15")
    assert fields["NodeList"] == "node1"
    assert fields["TRES"] == "cpu=1,mem=512M,node=1,billing=1" and fields["Power"] == ""


def test_scontrol_keeps_a_job_name_with_a_space_and_an_empty_nodelist() -> None:
    assert parse_scontrol_job(SCONTROL_FAILED_NAMED)["JobName"] == "my job"
    assert parse_scontrol_job(SCONTROL_PENDING_AFTER_REQUEUE)["NodeList"] == ""


def test_sacct_duplicates_give_one_record_per_attempt_oldest_first() -> None:
    records = parse_sacct(SACCT_CANCELLED_AFTER_RESTART)
    assert [r["State"] for r in records] == ["REQUEUED", "CANCELLED by 0"]
    assert [r["Elapsed"] for r in records] == ["00:00:06", "00:00:08"]
    assert records[1]["Start"] == "2026-12-02T18:44:32" and records[1]["NodeList"] == "node1"


def test_sacct_output_with_other_fields_is_refused() -> None:
    with pytest.raises(ValueError, match="has 2 fields, expected 7"):
        parse_sacct("CANCELLED by 0|0:0\n")  # `-o State,ExitCode`


def test_job_state_reads_state_restarts_exit_code_and_nodes_from_scontrol(monkeypatch) -> None:
    _serve(
        monkeypatch,
        [
            Poll(SCONTROL_RUNNING),
            Poll(SCONTROL_PENDING_AFTER_REQUEUE),
            Poll(SCONTROL_CANCELLED_AFTER_RESTART),
            Poll(SCONTROL_FAILED_NAMED),
        ],
    )
    assert job_state("1") == JobState("1", "RUNNING", 0, 0, 0, "node1", "None", "scontrol")
    assert job_state("1") == JobState("1", "PENDING", 0, 0, 1, "", "BeginTime", "scontrol")
    assert job_state("1") == JobState("1", "CANCELLED", 0, 15, 1, "node1", "None", "scontrol")
    assert job_state("4") == JobState("4", "FAILED", 3, 0, 0, "node1", "NonZeroExitCode", "scontrol")


def test_a_requeued_job_gone_from_scontrol_counts_its_restarts_from_the_duplicate_records(monkeypatch) -> None:
    _serve(
        monkeypatch,
        [
            Poll(None, SACCT_RUNNING, SACCT_RUNNING),
            Poll(None, SACCT_PENDING_AFTER_REQUEUE, SACCT_PENDING_AFTER_REQUEUE),
            Poll(None, SACCT_RERUN, SACCT_RERUN_LAST_ONLY),
            Poll(None, SACCT_CANCELLED_AFTER_RESTART, SACCT_CANCELLED_LAST_ONLY),
        ],
    )
    assert job_state("1") == JobState("1", "RUNNING", 0, 0, 0, "node1", "", "sacct")
    assert job_state("1") == JobState("1", "REQUEUED", 0, 0, 1, "node1", "", "sacct")  # scontrol: Restarts=1
    assert job_state("1") == JobState("1", "RUNNING", 0, 0, 1, "node1", "", "sacct")
    assert job_state("1") == JobState("1", "CANCELLED", 0, 0, 1, "node1", "", "sacct")


def test_sacct_attempts_lists_the_requeued_attempt_and_the_last_one(monkeypatch) -> None:
    _serve(monkeypatch, [Poll(None, SACCT_CANCELLED_AFTER_RESTART, SACCT_CANCELLED_LAST_ONLY)])
    attempts = sacct_attempts("1")
    assert [(a["JobID"], a["State"], a["End"]) for a in attempts] == [
        ("1", "REQUEUED", "2026-12-02T18:44:20"),
        ("1", "CANCELLED by 0", "2026-12-02T18:44:40"),
    ]


def test_sacct_attempts_is_empty_without_sacct_or_without_accounting(monkeypatch) -> None:
    def no_sacct(cmd, **kw):
        raise FileNotFoundError(2, "No such file or directory", cmd[0])

    def accounting_off(cmd, **kw):  # what sacct 22.05 says with AccountingStorageType=accounting_storage/none
        return subprocess.CompletedProcess(cmd, 1, "", "Slurm accounting storage is disabled\n")

    monkeypatch.setattr(slurm_state.subprocess, "run", no_sacct)
    assert sacct_attempts("1") == []
    monkeypatch.setattr(slurm_state.subprocess, "run", accounting_off)
    assert sacct_attempts("1") == []
    assert job_state("1") == JobState("1", "UNKNOWN")


def test_the_wait_follows_a_requeued_job_until_it_ends(monkeypatch, tmp_path: Path, capsys) -> None:
    calls = _serve(
        monkeypatch,
        [
            Poll(SCONTROL_RUNNING),
            Poll(SCONTROL_RUNNING),
            Poll(SCONTROL_PENDING_AFTER_REQUEUE),
            Poll(SCONTROL_CANCELLED_AFTER_RESTART),
        ],
    )
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n')
    assert wait_for_job("1", tmp_path, poll_s=0) == exitcodes.FAILED
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "job 1: RUNNING",
        "  step=1 loss=2.5",
        "job 1: PENDING (restart 1)",
        "job 1: CANCELLED (restart 1)",
    ]
    assert "job 1 ended CANCELLED with exit code 0:15" in err and len(calls) == 4


def test_a_failed_job_ends_the_wait_with_its_own_exit_code(monkeypatch, tmp_path: Path) -> None:
    _serve(monkeypatch, [Poll(SCONTROL_FAILED_NAMED)])
    assert wait_for_job("4", tmp_path, poll_s=0) == 3


def test_preempted_ends_the_wait_with_the_requeue_exit_code(monkeypatch, tmp_path: Path, capsys) -> None:
    _serve(monkeypatch, [Poll(SCONTROL_RUNNING), Poll(SCONTROL_PREEMPTED)])
    assert wait_for_job("1", tmp_path, poll_s=0) == exitcodes.REQUEUE == 75
    assert f"resubmit with run.dir={tmp_path}" in capsys.readouterr().err


def test_preempted_from_sacct_ends_the_wait_once_scontrol_forgot_the_job(monkeypatch, tmp_path: Path) -> None:
    _serve(monkeypatch, [Poll(None, SACCT_RERUN, SACCT_RERUN_LAST_ONLY), Poll(None, SACCT_PREEMPTED, "")])
    assert wait_for_job("1", tmp_path, poll_s=0) == exitcodes.REQUEUE


def test_a_final_state_the_code_does_not_know_stops_the_wait(monkeypatch, tmp_path: Path, capsys) -> None:
    _serve(monkeypatch, [Poll(SCONTROL_RUNNING), Poll(SCONTROL_NEW_STATE)])
    assert wait_for_job("1", tmp_path, poll_s=0) == exitcodes.FAILED
    assert "job 1 is in state LAUNCH_FAILED, which meshjob does not know" in capsys.readouterr().err


def test_a_job_neither_scontrol_nor_sacct_knows_stops_the_wait_after_5_polls(monkeypatch, tmp_path, capsys) -> None:
    calls = _serve(monkeypatch, [Poll(None)] * 5)
    assert wait_for_job("999999", tmp_path, poll_s=0) == exitcodes.ENV_ERROR
    assert sum(c[0] == "scontrol" for c in calls) == 5
    assert "neither scontrol nor sacct knows it" in capsys.readouterr().err
