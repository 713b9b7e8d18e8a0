"""The supervisor's guard and the torchrun agent's exit code: a dead supervisor is told from a scancel and
requeued within the budget; the ranks' "do not requeue" reaches Slurm through torchrun."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from jobs import exitcodes
from jobs.config import FailureConfig
from jobs.events import EventLog, read_events
from jobs.failure import policy
from jobs.failure.policy import Decision, publish
from jobs.launch import slurm as slurm_mod
from jobs.launch import slurm_state, supervise
from jobs.launch.env import DistEnv


def test_slurm_intent_tells_a_dead_batch_step_from_scancel_and_the_time_limit(monkeypatch) -> None:
    # Seen on the local cluster (22.05), scontrol while the ranks hold their SIGTERM: the batch python
    # SIGKILLed -> COMPLETING NonZeroExitCode 137:0; the batch shell SIGKILLed -> COMPLETING JobLaunchFailure
    # 0:9; scancel -> COMPLETING None 0:15.
    states = {
        "1": slurm_state.JobState("1", "COMPLETING", 137, reason="NonZeroExitCode"),
        "2": slurm_state.JobState("2", "COMPLETING", 0, 9, reason="JobLaunchFailure"),
        "3": slurm_state.JobState("3", "COMPLETING", 0, 15, reason="None"),
        "4": slurm_state.JobState("4", "COMPLETING", 0, 15, reason="TimeLimit"),
        "5": slurm_state.JobState("5", "COMPLETING", 137, restarts=1, reason="NonZeroExitCode"),
    }
    monkeypatch.setattr(policy, "job_state", states.__getitem__)
    assert [policy.slurm_intent(j, restart_count=0) for j in "12345"] == [
        "supervisor_died",
        "supervisor_died",
        "cancelled",
        "cancelled",
        "requeued",
    ]


@pytest.mark.parametrize("cause", ["SIGTERM", "supervisor_died"])
def test_a_dead_supervisor_is_requeued_within_the_budget_then_stopped(cause: str) -> None:
    cfg = FailureConfig(max_requeues=2)
    d = policy.decide(
        [], cause=cause, cfg=cfg, restart_count=1, slurm="supervisor_died" if cause == "SIGTERM" else None
    )
    assert (d.action, d.exit_code) == ("requeue", exitcodes.REQUEUE)
    assert d.reason == "supervisor_died: requeue 2 of failure.max_requeues(2)"
    spent = policy.decide([], cause=cause, cfg=cfg, restart_count=2, slurm="supervisor_died")
    assert (spent.action, spent.exit_code) == ("stop", exitcodes.STOPPED)
    # A class that a restart does not cure stays a stop, whoever else died.
    assert policy.decide([], cause="config_error", cfg=cfg, restart_count=0, slurm="supervisor_died").action == "stop"


def _cfg(tmp_path: Path, **failure) -> SimpleNamespace:
    return SimpleNamespace(
        run=SimpleNamespace(dir=str(tmp_path)),
        world_size=2,
        failure=FailureConfig(heartbeat_s=0.05, **failure),
        cluster=SimpleNamespace(exclude=None, partition="gpu"),
        launcher=SimpleNamespace(nodes=3, spare_nodes=1),
        checkpoint=SimpleNamespace(enabled=True, memory_on=False),  # no RAM tier: nothing to scavenge
    )


@pytest.mark.parametrize(
    ("end", "after"),
    [("return 76", None), ("SIGKILL", "was killed by SIGKILL"), ("raise", "raised an exception (traceback above)")],
)
def test_the_guard_outlives_its_supervisor_and_acts_only_when_it_died(
    tmp_path: Path, monkeypatch, end: str, after: str | None
) -> None:
    def fake_supervise(cfg, *, logs):
        if end == "SIGKILL":
            os.kill(os.getpid(), signal.SIGKILL)
        if end == "raise":
            raise OSError("No space left on device")
        return exitcodes.STOPPED

    seen: list[str] = []
    monkeypatch.setattr(supervise, "supervise", fake_supervise)
    monkeypatch.setattr(supervise, "_after_supervisor_death", lambda cfg, *, pid, how: seen.append(how) or 75)
    try:
        code = supervise.guarded(_cfg(tmp_path), logs=("o", "e"))
    finally:
        for s in (signal.SIGTERM, signal.SIGUSR2):
            signal.signal(s, signal.SIG_DFL)
    assert (code, seen) == ((exitcodes.STOPPED, []) if after is None else (75, [after]))


def test_with_no_ranks_running_the_guard_decides_in_the_dead_supervisors_place(tmp_path: Path, monkeypatch) -> None:
    from jobs.failure import respond

    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    EventLog(tmp_path / "events.jsonl", rank=-1, restart=1, attempt="41.1.2").emit("attempt_start", job_id="41")
    publish(tmp_path, "41.1.2", Decision("restart", "dead_rank: restart 3", 75, 1, 10, 0))  # nobody starts it now
    asked: list[str] = []
    monkeypatch.setattr(supervise, "_numbered_steps", lambda: [])
    monkeypatch.setattr(respond, "slurm_intent", lambda job_id, restart_count: None)
    monkeypatch.setattr(respond, "requeue_job", lambda job_id: asked.append(job_id) or (True, ""))
    code = supervise._after_supervisor_death(_cfg(tmp_path), pid=7, how="was killed by SIGKILL")
    assert (code, asked) == (exitcodes.REQUEUE, ["41"])
    (f,) = read_events(tmp_path / "events.jsonl", "failure")
    assert (f["cls"], f["attempt"]) == ("supervisor_died", "41.1.2") and "deciding in its place" in f["summary"]
    (d,) = read_events(tmp_path / "events.jsonl", "decision")
    assert (d["attempt"], d["action"], d["reason"]) == (
        "41.1.3",
        "requeue",
        "supervisor_died: requeue 2 of failure.max_requeues(10)",
    )


def test_the_current_attempt_is_the_newest_start_of_this_allocation(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "events.jsonl", rank=-1)
    for a in ("5.0", "5.1", "5.1.1", "5.10", "6.1"):
        log.emit("attempt_start", attempt=a)
    assert supervise._current_attempt(str(tmp_path), "5", 1) == ("5.1.1", 1)
    assert supervise._current_attempt(str(tmp_path), "5", 2) == ("5.2", 0)


@pytest.mark.parametrize(
    ("codes", "code"),
    [([76, 76], 76), ([75, 76], 76), ([75], 75), ([77, 76], 77), ([-9], 137), ([1, -15], 1), ([3], 3)],
)
def test_the_agent_exits_with_the_ranks_most_final_code(codes: list[int], code: int) -> None:
    assert slurm_mod.agent_exit_code(codes) == code


def test_restarted_ranks_under_torchrun_find_the_stop_past_attempts_that_only_read_it(tmp_path: Path) -> None:
    # torchrun restarts the ranks up to --max-restarts times after a stop: attempt .2 found the stop of .1 and
    # exited, so .3 found no decision of .2 and trained again (a second crash, a second stop).
    cfg = SimpleNamespace(run=SimpleNamespace(dir=str(tmp_path)))
    publish(tmp_path, "9.0", Decision("restart", "rank_crashed: restart 1", 75, 0, 4, 1))
    env = DistEnv(
        rank=0,
        local_rank=0,
        world_size=2,
        local_world_size=1,
        node_rank=0,
        nodes=2,
        master_addr="a",
        master_port=1,
        restart_in_allocation=3,
        job_id="9",
    )
    assert slurm_mod._ended_for_good(cfg, env) is None
    publish(tmp_path, "9.0.1", Decision("stop", "2 attempts in a row", 76, 0, 4, 2))
    assert slurm_mod._ended_for_good(cfg, env) == exitcodes.STOPPED


def test_when_the_decider_and_then_the_supervisor_die_the_guard_requeues(tmp_path: Path, monkeypatch) -> None:
    # The double fault: rank 1 claimed the decision of 41.0 and died; then the supervisor died. Before: the guard
    # waited for a decision that never came and returned 75 without requeueing (the job ended FAILED).
    from jobs.failure import respond

    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    EventLog(tmp_path / "events.jsonl", rank=-1, restart=0, attempt="41.0").emit("attempt_start", job_id="41")
    assert policy.claim(tmp_path, "41.0", rank=1)
    asked: list[str] = []
    monkeypatch.setattr(supervise, "_numbered_steps", lambda: [])
    monkeypatch.setattr(respond, "slurm_intent", lambda job_id, restart_count: None)
    monkeypatch.setattr(respond, "requeue_job", lambda job_id: asked.append(job_id) or (True, ""))
    code = supervise._after_supervisor_death(_cfg(tmp_path), pid=7, how="was killed by SIGKILL")
    assert (code, asked) == (exitcodes.REQUEUE, ["41"])
    d = policy.read_decision(tmp_path, "41.0", wait_s=0)
    assert (d["action"], d["reason"]) == ("requeue", "dead_rank: requeue 1 of failure.max_requeues(10)"), d
    assert (
        "claimed the decision of attempt 41.0 and died"
        in read_events(tmp_path / "events.jsonl", "failure")[-1]["summary"]
    )


def test_the_guard_decides_with_the_jobs_partition_and_the_nodes_it_needs(tmp_path: Path, monkeypatch) -> None:
    # A quarantine decided here must leave `nodes_needed` usable nodes in the job's partition (respond._quarantine):
    # the guard's context had neither (None, 1), so a requeue it decided was checked against the default partition
    # and one node. Every supervisor context now takes both from the config.
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    EventLog(tmp_path / "events.jsonl", rank=-1, restart=0, attempt="41.0").emit("attempt_start", job_id="41")
    seen: list = []
    monkeypatch.setattr(supervise, "_numbered_steps", lambda: [])
    monkeypatch.setattr(supervise, "conclude", lambda ctx, **kw: seen.append(ctx) or exitcodes.REQUEUE)
    assert supervise._after_supervisor_death(_cfg(tmp_path), pid=7, how="was killed by SIGKILL") == exitcodes.REQUEUE
    (ctx,) = seen
    assert (ctx.attempt, ctx.partition, ctx.nodes_needed) == ("41.0", "gpu", 4)
