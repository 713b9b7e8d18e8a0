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
from tests.chaos.chaos_helpers import (STEP_S, DONE_S, assert_bitwise_equal_to_reference, bound_s, events, wait_for_step,
                                       wait_job_done)
from tests.slurm.slurm_helpers import cli, scontrol_job, submitted_job_id

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]

COMMON = chaos_helpers.COMMON  # the chaos tier's job (STEPS steps); every fault here comes at step 40
# `reference`: the session's uninterrupted run of it (tests/chaos/conftest.py)


def submit(run_dir: Path, *extra: str) -> str:
    r = cli("jobs.train", "launcher=slurm", *COMMON, *extra, f"run.dir={run_dir}")
    assert r.returncode == 0, r.stdout + r.stderr
    return submitted_job_id(r.stdout)


def _states(recs: list[dict]) -> list[str]:
    return [r["State"].split()[0] for r in recs]


def _supervisor_and_guard(run_dir: Path) -> tuple[int, int]:
    """The batch step's two pythons, found from outside: the supervisor is the parent of the ranks'
    `srun` (its --rank-config lies in this run dir), the guard is the supervisor's parent."""
    ps = subprocess.run(["ps", "-ww", "-eo", "pid=,ppid=,args="], capture_output=True, text=True, check=True).stdout
    procs = {int(p): (int(pp), args) for p, pp, args in (line.split(None, 2) for line in ps.splitlines() if line.strip())}
    sruns = {p for p, (_, args) in procs.items() if args.startswith("srun ") and "--rank-config" in args
             and str(run_dir) in args}
    (srun_parent,) = {procs[p][0] for p in sruns} - sruns  # srun runs a child srun of its own
    return srun_parent, procs[srun_parent][0]


def _sbatch(run_dir: Path, style: str, *extra: str) -> str:
    """A script rendered by `python -m jobs.sbatch --style STYLE`, submitted with plain sbatch."""
    script = run_dir / "job.sbatch"
    run_dir.mkdir(parents=True)
    r = cli("jobs.sbatch", "--style", style, "-o", str(script), "launcher=slurm", *COMMON, *extra, f"run.dir={run_dir}")
    assert r.returncode == 0, r.stderr
    return subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True,
                          cwd="/tmp").stdout.strip()


@pytest.mark.timeout(bound_s(STEP_S, DONE_S))  # its own waits are the bound (tests/chaos/chaos_helpers.py)
def test_a_killed_supervisor_is_outlived_by_its_guard_the_ranks_save_requeue_and_finish_bitwise(
        run_root: Path, reference, tmp_path) -> None:
    # Before the guard, the batch script ended with the supervisor (137), Slurm ended the job, the ranks
    # read their SIGTERM as a scancel: FAILED, nothing requeued.
    job = submit(run_root)
    wait_for_step(run_root, 40)
    supervisor, guard = _supervisor_and_guard(run_root)
    os.kill(supervisor, signal.SIGKILL)
    recs = wait_job_done(job)
    assert _states(recs) == ["REQUEUED", "COMPLETED"], recs
    assert scontrol_job(job)["Restarts"] == "1"
    (died,) = [e for e in events(run_root, "failure") if e["cls"] == "supervisor_died"]
    assert died["attempt"] == f"{job}.0" and f"pid {supervisor}) was killed by SIGKILL" in died["summary"], died
    # The guard stopped the ranks as a preemption does: they saved the next step, their decider requeued.
    assert [(e["attempt"], e["action"]) for e in events(run_root, "decision")] == [(f"{job}.0", "requeue")]
    assert {e["signal"] for e in events(run_root, "stop_requested")} == {"SIGUSR2"}
    (stop,) = {e["step"] for e in events(run_root, "stop_requested")}
    assert [(e["step"], e["attempt"]) for e in events(run_root, "checkpoint_loaded")] == [(stop, f"{job}.1")]
    assert_bitwise_equal_to_reference(run_root, reference, tmp_path)


@pytest.mark.timeout(bound_s(STEP_S, DONE_S))  # its own waits are the bound (tests/chaos/chaos_helpers.py)
def test_a_batch_step_killed_whole_is_told_from_scancel_by_the_ranks_and_requeued_bitwise(
        run_root: Path, reference, tmp_path) -> None:
    # The guard and the supervisor both SIGKILLed (the OOM killer's worst case): the batch script ends, Slurm
    # SIGTERMs the ranks. Their decider asks Slurm: COMPLETING with reason NonZeroExitCode, not a scancel.
    job = submit(run_root)
    wait_for_step(run_root, 40)
    supervisor, guard = _supervisor_and_guard(run_root)
    os.kill(guard, signal.SIGKILL)
    os.kill(supervisor, signal.SIGKILL)
    recs = wait_job_done(job)
    assert _states(recs) == ["REQUEUED", "COMPLETED"], recs
    assert scontrol_job(job)["Restarts"] == "1"
    (d,) = events(run_root, "decision")
    assert (d["attempt"], d["cause"], d["action"]) == (f"{job}.0", "SIGTERM", "requeue"), d
    assert d["reason"].startswith("supervisor_died: requeue 1 of failure.max_requeues"), d
    assert_bitwise_equal_to_reference(run_root, reference, tmp_path)


@pytest.mark.timeout(bound_s(STEP_S, DONE_S))  # its own waits are the bound (tests/chaos/chaos_helpers.py)
def test_torchrun_style_under_an_admins_requeue_leaves_sigterm_to_the_ranks_which_save_and_finish_bitwise(
        run_root: Path, reference, tmp_path) -> None:
    # torch's agent catches SIGTERM and SIGKILLs its ranks after its shutdown timeout (30 s by default): a save
    # longer than that was cut off. The timeout at 0 here makes that visible in seconds: before the fix no rank
    # saved the stop step and the requeued job resumed from an older checkpoint.
    job = _sbatch(run_root, "torchrun", "+cluster.env.TORCH_ELASTIC_SHUTDOWN_TIMEOUT=0")
    wait_for_step(run_root, 40)
    subprocess.run(["scontrol", "requeue", job], check=True)
    recs = wait_job_done(job)
    assert _states(recs) == ["REQUEUED", "COMPLETED"], recs
    assert {e["signal"] for e in events(run_root, "stop_requested") if e["rank"] == 0} == {"SIGTERM"}
    (stop,) = {e["step"] for e in events(run_root, "stop_requested")}
    assert [e["step"] for e in events(run_root, "checkpoint_loaded")] == [stop]
    agent_logs = "".join(p.read_text() for p in (run_root / "slurm").glob(f"{job}_r0_node*.err"))
    assert "death signal" not in agent_logs, agent_logs[-2000:]
    assert_bitwise_equal_to_reference(run_root, reference, tmp_path)


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
