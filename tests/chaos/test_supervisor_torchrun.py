"""Chaos tier, part 3: the job's own supervisor killed from outside, and the torchrun-style script under an
admin's requeue (SIGTERM) and in a crash loop; each asserts what Slurm reports and, where the job must
finish, that its losses and final state are bitwise those of an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.chaos import chaos_helpers
from tests.chaos.chaos_helpers import (
    DONE_S,
    STEP_S,
    assert_bitwise_equal_to_reference,
    bound_s,
    events,
    node_pid,
    supervisor_and_guard,
    wait_for_step,
    wait_job_done,
)
from tests.slurm.slurm_helpers import cli, scontrol_job, submitted_job_id

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]

COMMON = chaos_helpers.COMMON  # the chaos tier's job (STEPS steps); the killed supervisor comes at step 40
# `reference`: the session's uninterrupted run of it (tests/chaos/conftest.py)


def submit(run_dir: Path, *extra: str) -> str:
    r = cli("jobs.train", "launcher=slurm", *COMMON, *extra, f"run.dir={run_dir}")
    assert r.returncode == 0, r.stdout + r.stderr
    return submitted_job_id(r.stdout)


def _states(recs: list[dict]) -> list[str]:
    return [r["State"].split()[0] for r in recs]


def _sbatch(run_dir: Path, style: str, *extra: str, steps: int = chaos_helpers.STEPS) -> str:
    """A script rendered by `python -m jobs.sbatch sbatch.style=STYLE` (a `steps`-step run), submitted with plain sbatch."""
    script = run_dir / "job.sbatch"
    run_dir.mkdir(parents=True)
    r = cli(
        "jobs.sbatch",
        f"sbatch.style={style}",
        f"sbatch.out={script}",
        "launcher=slurm",
        *chaos_helpers.common(steps),
        *extra,
        f"run.dir={run_dir}",
    )
    assert r.returncode == 0, r.stderr
    return subprocess.run(
        ["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True, cwd="/tmp"
    ).stdout.strip()


def _wait_for_progress(run_dir: Path, attempt: str, *, timeout: float = STEP_S) -> None:
    """Until `attempt` has committed a checkpoint past the step it loaded (the ledger's checkpoint_saved)."""
    deadline = time.monotonic() + timeout
    while True:
        loaded = [e["step"] for e in events(run_dir, "checkpoint_loaded") if e["attempt"] == attempt]
        if loaded and any(
            e["attempt"] == attempt and e["step"] > loaded[0] for e in events(run_dir, "checkpoint_saved")
        ):
            return
        assert time.monotonic() < deadline, f"{attempt} committed no new checkpoint within {timeout} s"
        time.sleep(0.2)


@pytest.mark.timeout(bound_s(STEP_S, STEP_S, DONE_S))  # its own waits are the bound (tests/chaos/chaos_helpers.py)
def test_a_killed_supervisor_then_a_batch_step_killed_whole_requeue_and_the_run_finishes_bitwise(
    run_root: Path, reference, tmp_path
) -> None:
    # One job, two faults, each in its own run (once a job each: the same requeue and finish, ~15 s of CI less).
    # 1. The supervisor SIGKILLed: before the guard, the batch script ended with it (137), Slurm ended the job,
    #    the ranks read their SIGTERM as a scancel: FAILED, nothing requeued.
    # 2. In the requeued run, the guard and the supervisor both SIGKILLed (the OOM killer's worst case): the batch
    #    script ends, Slurm SIGTERMs the ranks. Their decider asks Slurm: COMPLETING with reason NonZeroExitCode,
    #    not a scancel. It comes after that run committed a new step, so the no-progress breaker cannot stop
    #    the job.
    job = submit(run_root)
    wait_for_step(run_root, 40)
    supervisor, _ = supervisor_and_guard(run_root)
    supervisor_on_node = node_pid(supervisor)  # the pid its node knows it by, which the summary names
    os.kill(supervisor, signal.SIGKILL)
    _wait_for_progress(run_root, f"{job}.1")
    supervisor1, guard1 = supervisor_and_guard(run_root)
    assert supervisor1 != supervisor
    os.kill(guard1, signal.SIGKILL)
    os.kill(supervisor1, signal.SIGKILL)
    recs = wait_job_done(job)
    assert _states(recs) == ["REQUEUED", "REQUEUED", "COMPLETED"], recs
    assert scontrol_job(job)["Restarts"] == "2"
    (died,) = [e for e in events(run_root, "failure") if e["cls"] == "supervisor_died" and e["attempt"] == f"{job}.0"]
    assert f"pid {supervisor_on_node}) was killed by SIGKILL" in died["summary"], died
    # 1: the guard stopped the ranks as a preemption does: they saved the next step, their decider requeued.
    d0, d1 = events(run_root, "decision")
    assert (d0["attempt"], d0["action"]) == (f"{job}.0", "requeue"), d0
    stops = [e for e in events(run_root, "stop_requested") if e["attempt"] == f"{job}.0"]
    assert {e["signal"] for e in stops} == {"SIGUSR2"}
    (stop,) = {e["step"] for e in stops}
    loaded = [(e["step"], e["attempt"]) for e in events(run_root, "checkpoint_loaded")]
    assert loaded[0] == (stop, f"{job}.1") and [a for _, a in loaded] == [f"{job}.1", f"{job}.2"], loaded
    # 2: told from a scancel, requeued within the budget
    assert (d1["attempt"], d1["cause"], d1["action"]) == (f"{job}.1", "SIGTERM", "requeue"), d1
    assert d1["reason"].startswith("supervisor_died: requeue 2 of failure.max_requeues"), d1
    assert_bitwise_equal_to_reference(run_root, reference, tmp_path)


@pytest.mark.timeout(bound_s(STEP_S, DONE_S))  # its own waits are the bound (tests/chaos/chaos_helpers.py)
def test_torchrun_style_under_an_admins_requeue_leaves_sigterm_to_the_ranks_which_save_and_finish_bitwise(
    run_root: Path, short_reference, tmp_path
) -> None:
    # torch's agent catches SIGTERM and SIGKILLs its ranks after its shutdown timeout (30 s by default): a save
    # longer than that was cut off. The timeout at 0 here makes that visible in seconds: before the fix no rank
    # saved the stop step and the requeued job resumed from an older checkpoint.
    job = _sbatch(
        run_root, "torchrun", "+cluster.env.TORCH_ELASTIC_SHUTDOWN_TIMEOUT=0", steps=chaos_helpers.SHORT_STEPS
    )
    wait_for_step(run_root, chaos_helpers.SHORT_FAULT_STEP)
    subprocess.run(["scontrol", "requeue", job], check=True)
    recs = wait_job_done(job)
    assert _states(recs) == ["REQUEUED", "COMPLETED"], recs
    assert {e["signal"] for e in events(run_root, "stop_requested") if e["rank"] == 0} == {"SIGTERM"}
    (stop,) = {e["step"] for e in events(run_root, "stop_requested")}
    assert [e["step"] for e in events(run_root, "checkpoint_loaded")] == [stop]
    agent_logs = "".join(p.read_text() for p in (run_root / "slurm").glob(f"{job}_r0_node*.err"))
    assert "death signal" not in agent_logs, agent_logs[-2000:]
    assert_bitwise_equal_to_reference(run_root, short_reference, tmp_path)


@pytest.mark.timeout(bound_s(STEP_S, DONE_S))  # its own waits are the bound (tests/chaos/chaos_helpers.py)
def test_torchrun_style_in_a_crash_loop_stops_at_the_budget_with_exit_76(run_root: Path) -> None:
    # torch's agent restarted the ranks after a stop (attempt .3 trained again: no decision of .2 to read)
    # and ended with 1 (ChildFailedError), so the job said "failed" where the ranks said "do not requeue".
    data = run_root / "tokens.h5"
    job = _sbatch(run_root, "torchrun", f"data.path={data}", "checkpoint.every_steps=1000")
    deadline = time.monotonic() + 300
    while not (run_root / "config.yaml").exists():  # --prepare in the batch step has written the data file
        assert time.monotonic() < deadline, scontrol_job(job)
        time.sleep(0.05)
    data.write_bytes(b"")  # from outside, before the ranks read it: every start of every rank fails
    recs = wait_job_done(job)
    assert _states(recs) == ["FAILED"] and recs[-1]["ExitCode"] == "76:0", recs
    assert scontrol_job(job)["Restarts"] == "0"
    decisions = [(e["attempt"], e["action"], e["exit_code"]) for e in events(run_root, "decision")]
    assert decisions == [(f"{job}.0", "restart", 75), (f"{job}.0.1", "stop", 76)], decisions
