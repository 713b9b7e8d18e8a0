"""The requeue path on the real local cluster, faults from outside: a quarantine list written by hand (bare names, one
Slurm does not know) must not leave the requeued job held or failed, and a stop-notice requeue after committed
progress spends no failure.max_requeues; a decider killed before it published its decision is replaced by the
supervisor, and, killed again with the supervisor, by the guard; a stop notice that reaches the decider while it
decides a restart (slurmctld stopped meanwhile) turns the restart into a requeue."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from checkpoint.config import memory_root
from jobs.launch.rundir import run_id
from tests.chaos.chaos_helpers import (
    DONE_S,
    SHORT_FAULT_STEP,
    SHORT_STEPS,
    SLURM_RUN,
    STEP_S,
    assert_bitwise_equal_to_reference,
    bound_s,
    events,
    host_pid,
    losses,
    node_path,
    rank_pid,
    submit,
    supervisor_and_guard,
    wait_for_step,
    wait_job_done,
)
from tests.slurm.slurm_helpers import scontrol_job

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]

STEPS = 60
BACK_S = 420  # _back_running's bound
ENDED_BADLY = ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
KILL_STEP = 45  # the requeued run's kill -9: past the stop step (~31), before the save at 50


def _back_running(job: str, *, timeout: float = BACK_S) -> list[tuple[str, str, str]]:
    """(JobState, Reason, Restarts) as seen every 0.5 s until the job runs again after its requeue (other
    jobs on the shared cluster may hold node2/node3 for a while); fails at once when it is seen held
    (PENDING with Reason job_requeued_in_held_state, as before the fix, or JobHeld*): nothing holds it now; and when
    it is seen ended otherwise (a decision path that raised stopped it: FAILED), not after `timeout`."""
    seen: list[tuple[str, str, str]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = scontrol_job(job)
        seen.append((info["JobState"], info["Reason"], info["Restarts"]))
        assert "held" not in info["Reason"].lower(), seen[-3:]
        assert info["JobState"] not in ENDED_BADLY, seen[-3:]  # ended instead of coming back: say so at once
        if info["Restarts"] == "1" and info["JobState"] in ("RUNNING", "COMPLETED"):
            return seen
        time.sleep(0.5)
    raise AssertionError(f"job {job} not running again {timeout} s after its requeue: {seen[-3:]}")


@pytest.mark.timeout(bound_s(STEP_S, BACK_S, STEP_S, DONE_S))  # its own waits are the bound
def test_a_hand_written_quarantine_list_a_free_stop_requeue_then_a_kill_past_the_budget_requeue_and_finish_bitwise(
    run_root: Path, short_reference, tmp_path
) -> None:
    # One job, two requeues with failure.max_requeues=1:
    # 1. quarantine.json written by hand in the form people write (bare names, `["node99", "node1"]`; node99 was a
    #    node once, removed from slurm.conf since), then USR2 (scancel --signal=USR2, a preemption): the ranks save
    #    the stop step and requeue without node1. Before: a bare name raised in the decision path (FAILED at once);
    #    a name Slurm does not know left the job held for good (the old requeuehold -> update -> release).
    # 2. In the requeued run, kill -9 of rank 1 with failure.restarts_in_allocation=0: requeued again (the first
    #    requeue, a stop notice after committed progress, is free; before, it counted: stop, exit 76, FAILED), and
    #    the killed rank's node, which answers its probe, is not quarantined (the hand-written list stays as written).
    job = submit(run_root, "failure.max_requeues=1", "failure.restarts_in_allocation=0", steps=SHORT_STEPS)
    hand_written = ["node99", "node1"]
    try:
        wait_for_step(run_root, SHORT_FAULT_STEP)
        (run_root / "quarantine.json").write_text(json.dumps(hand_written))
        subprocess.run(["scancel", "--signal=USR2", job], check=True)  # a preemption: save, then requeue
        _back_running(job)
        wait_for_step(run_root, KILL_STEP)
        os.kill(rank_pid(run_root, f"{job}.1", 1), signal.SIGKILL)
        recs = wait_job_done(job)
    finally:
        subprocess.run(["scancel", job], capture_output=True)  # a no-op unless the job was left held
    assert [r["State"].split()[0] for r in recs] == ["REQUEUED", "REQUEUED", "COMPLETED"], recs
    info = scontrol_job(job)
    assert recs[-1]["NodeList"] == "node[2-3]" and (info["ExcNodeList"], info["Restarts"]) == ("node1", "2"), (
        recs,
        info,
    )
    d0, d1 = events(run_root, "decision")
    assert (d0["attempt"], d0["cause"], d0["action"], d0["free"]) == (f"{job}.0", "SIGUSR2", "requeue", True), d0
    assert (d1["attempt"], d1["cause"], d1["action"], d1["exit_code"]) == (f"{job}.1", "dead_rank", "requeue", 75), d1
    assert "failure.restarts_in_allocation(0) spent" in d1["reason"] and sorted(d1["excluded"]) == [
        "node1",
        "node99",
    ], d1
    requeues = events(run_root, "requeue")
    assert [(r["ok"], "dropped node(s) Slurm does not know: node99" in r["scontrol"]) for r in requeues] == [
        (True, True),
        (True, True),
    ], requeues
    assert json.loads((run_root / "quarantine.json").read_text()) == hand_written
    log = "".join(p.read_text() for p in (run_root / "slurm" / job).glob("*_log.*"))
    assert "bare node name(s) node99, node1 taken as quarantined" in log
    (stop,) = {e["step"] for e in events(run_root, "stop_requested")}
    assert {e["signal"] for e in events(run_root, "stop_requested") if e["rank"] == 0} == {"SIGUSR2"}
    loaded = [(e["step"], e["attempt"]) for e in events(run_root, "checkpoint_loaded")]
    assert loaded[0] == (stop, f"{job}.1") and [a for _, a in loaded] == [f"{job}.1", f"{job}.2"], loaded
    assert_bitwise_equal_to_reference(run_root, short_reference, tmp_path)


def _claimer(path: Path, *, timeout: float = 120) -> dict:
    """The decider's claim ({rank, pid, host}) as soon as it is written."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            time.sleep(0.001)
    raise AssertionError(f"nobody claimed {path.parent.name} within {timeout} s")


@pytest.mark.timeout(bound_s(STEP_S, 120, STEP_S, 120, DONE_S))  # its own waits (_claimer's 120 s too) are the bound
def test_a_decider_killed_before_publishing_is_replaced_by_the_supervisor_then_by_the_guard_and_the_run_finishes(
    run_root: Path,
) -> None:
    # One job, two faults on the same rank:
    # 1. rank 1 killed, then its decider (rank 0) killed between claim and publish: the supervisor decides in its
    #    place and restarts the ranks (before: the step ended without a decision and the job ended there).
    # 2. In the restarted attempt, rank 1 killed again, then the decider, then the supervisor (the double fault):
    #    the guard decides in their place and requeues (before: the guard returned 75 without requeueing, the job
    #    ended). The fault followed the rank, on a node that answers: no node is quarantined. With the RAM tier on,
    #    the guard scavenges before its requeue (before: its context had no `before_requeue`).
    ram = ["checkpoint.memory_every_steps=5", "checkpoint.memory_replicas=0"]
    job = submit(run_root, f"train.steps={STEPS}", "checkpoint.every_steps=10", *ram)
    wait_for_step(run_root, 15)
    _kill_rank1_then_its_decider(run_root, f"{job}.0")
    wait_for_step(run_root, 35)  # the restarted attempt trains (it resumed from RAM)
    supervisor, _ = supervisor_and_guard(run_root)
    _kill_rank1_then_its_decider(run_root, f"{job}.0.1", then=supervisor)
    recs = wait_job_done(job)
    assert [r["State"].split()[0] for r in recs] == ["REQUEUED", "COMPLETED"], recs
    info = scontrol_job(job)
    assert (info["Restarts"], info["ExcNodeList"]) == ("1", "(null)"), info
    decisions = [(e["attempt"], e["rank"], e["action"]) for e in events(run_root, "decision")]
    assert decisions == [(f"{job}.0", -1, "restart"), (f"{job}.0.1", -1, "requeue")], decisions
    (died,) = [e["attempt"] for e in events(run_root, "failure") if e["cls"] == "supervisor_died"]
    assert died == f"{job}.0.1"
    assert not (run_root / "quarantine.json").exists()
    assert sorted(losses(run_root)) == list(range(1, STEPS + 1))
    scav = events(run_root, "ram_scavenged")
    assert [(e["when"], e["attempt"], e["rank"]) for e in scav] == [
        ("allocation_start", f"{job}.0", -1),
        ("requeue", f"{job}.0.1", -1),  # the guard's, before its `scontrol requeue`
        ("allocation_start", f"{job}.1", -1),
        ("allocation_end", f"{job}.1", -1),
    ], scav
    assert all(not e.get("failed_nodes") and not e.get("error") for e in scav), scav
    root = str(memory_root("/dev/shm", run_id(run_root)))
    assert [n for n in ("node1", "node2", "node3") if node_path(n, root).exists()] == []


def _kill_rank1_then_its_decider(run_root: Path, attempt: str, *, then: int | None = None) -> None:
    """kill -9 of rank 1 of `attempt`; the survivor (rank 0) claims the decision and is killed before publishing it;
    `then` (a pid on this host), if given, right after it."""
    os.kill(rank_pid(run_root, attempt, 1), signal.SIGKILL)
    folder = run_root / "incidents" / attempt
    who = _claimer(folder / ".claim")  # rank 0, the survivor, claims the decision, then probes node2 ...
    os.kill(host_pid(who["host"], who["pid"]), signal.SIGKILL)  # ... and dies before publishing it
    if then is not None:
        os.kill(then, signal.SIGKILL)
    assert who["rank"] == 0 and not (folder / "decision.json").exists()


# slurmctld held stopped while the decider decides: below MessageTimeout (5 s, scripts/slurm/start), so Slurm's
# clients wait for it rather than fail.
CTLD_STOPPED_S = 2.5


@pytest.mark.timeout(bound_s(STEP_S, 120, DONE_S))  # its own waits (_claimer's 120 s too) are the bound
def test_a_stop_notice_during_a_failure_with_slurmctld_stopped_requeues_instead_of_restarting_bitwise(
    run_root: Path, short_reference, tmp_path
) -> None:
    # A kill -9 of rank 1 (within failure.restarts_in_allocation: a restart inside the allocation
    # is due); the moment rank 0 claims the decision, slurmctld is SIGSTOPped (a busy controller: the decider's
    # `scontrol show job` and its probe of node2 wait on it) and the time-limit warning (SIGUSR2, as slurmstepd
    # delivers it) reaches rank 0. Before: the decider restarted the ranks, the new step started without the notice
    # and the time limit ended the job TIMEOUT. Now the pending stop turns the restart into a requeue; the stalled
    # probe is no evidence against node2 (nothing quarantined); the run finishes bitwise.
    job = submit(run_root, steps=SHORT_STEPS)
    wait_for_step(run_root, SHORT_FAULT_STEP)
    decider = rank_pid(run_root, f"{job}.0", 0)
    os.kill(rank_pid(run_root, f"{job}.0", 1), signal.SIGKILL)
    who = _claimer(run_root / "incidents" / f"{job}.0" / ".claim")
    ctld = int((SLURM_RUN / "slurmctld.pid").read_text())
    os.kill(ctld, signal.SIGSTOP)
    try:
        os.kill(decider, signal.SIGUSR2)
        time.sleep(CTLD_STOPPED_S)
        undecided = not (run_root / "incidents" / f"{job}.0" / "decision.json").exists()
    finally:
        os.kill(ctld, signal.SIGCONT)
    assert who["rank"] == 0 and undecided  # the notice and the stalled controller both came before the decision
    recs = wait_job_done(job)
    assert [r["State"].split()[0] for r in recs] == ["REQUEUED", "COMPLETED"], recs
    info = scontrol_job(job)
    assert (info["Restarts"], info["ExcNodeList"]) == ("1", "(null)"), info
    (d,) = events(run_root, "decision")
    assert (d["attempt"], d["cause"], d["action"]) == (f"{job}.0", "dead_rank", "requeue"), d
    assert d["reason"].startswith("dead_rank, and SIGUSR2 arrived: no restart inside the allocation"), d
    (rq,) = events(run_root, "requeue")
    assert rq["ok"] and rq["excluded"] == [], rq
    assert not (run_root / "quarantine.json").exists()
    assert [e["cause"] for e in events(run_root, "attempt_end")] == ["dead_rank", "completed"]
    assert_bitwise_equal_to_reference(run_root, short_reference, tmp_path)
