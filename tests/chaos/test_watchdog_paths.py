"""The watchdog's paths on the local Slurm cluster, faults from outside the job: a final save held by a frozen
filesystem for longer than the hang timeout completes; a SIGSTOPped rank (its heartbeat stops, its sockets stay
open) is named from its missed heartbeats in seconds, not after the hang timeout; a rank whose failure path cannot
write exits, and the supervisor decides in its place and restarts the ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.chaos.chaos_helpers import (
    SHORT_FAULT_STEP,
    SHORT_HANG_S,
    SHORT_STEPS,
    events,
    losses,
    rank_pid,
    reported_pid,
    submit,
    wait_for_step,
    wait_job_done,
)

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]

HANG_TIMEOUT_S = 20.0  # conf/failure/debug.yaml (heartbeat_s 1.0)
# The two tests below that wait out a whole hang timeout (a save held 1.5 of them; the supervisor's wait for a
# decision after a rank exited) run with chaos_helpers.SHORT_HANG_S.
# No reference run here: each case runs only as many steps as its fault needs (saves every 25 steps). A rank stopped
# at SHORT_FAULT_STEP (30), past the save at 25, leaves 30 steps of margin before the end of SHORT_STEPS (60) and 35
# steps to retrain; the final save is frozen 10 steps before the end, 15 past the save at 25 (as at 90 of 100).
FINAL_STEPS = 50


def _states(recs: list[dict]) -> list[str]:
    return [r["State"].split()[0] for r in recs]


def test_a_sigstopped_rank_is_named_from_its_missed_heartbeats_in_seconds(run_root: Path) -> None:
    job = submit(run_root, "failure.missed_beats=3", steps=SHORT_STEPS)
    wait_for_step(run_root, SHORT_FAULT_STEP)
    pid = reported_pid(run_root, f"{job}.0", 1)
    os.kill(rank_pid(run_root, f"{job}.0", 1), signal.SIGSTOP)  # its sockets stay open: rank 0 sees no connection reset
    t_stop = time.time()
    recs = wait_job_done(job)
    inc = json.loads((run_root / f"incidents/{job}.0/incident.json").read_text())
    assert inc["cls"] == "hung_rank", inc
    # rank 0 (on node1) cannot look at a process of another host: it names the rank, not its state
    assert [(s["rank"], s["node"], s["pid"], s["state"]) for s in inc["suspects"]] == [(1, "node2", pid, "unknown")]
    # about (missed_beats + 1) heartbeats = 4 s, against 20 s for the hang timeout
    assert inc["time"] - t_stop < 0.5 * HANG_TIMEOUT_S, inc["time"] - t_stop
    # the waiting rank dumped every thread's stack (its main thread in the collective, its watchdog)
    assert (run_root / f"incidents/{job}.0/stacks-rank0.txt").read_text().count("Thread") >= 2
    assert _states(recs) == ["COMPLETED"], recs  # the step was killed and the ranks restarted inside the job
    assert [e["action"] for e in events(run_root, "decision")] == ["restart"]
    assert losses(run_root).keys() == set(range(1, SHORT_STEPS + 1))


def test_a_final_save_held_longer_than_the_hang_timeout_completes(run_root: Path, tmp_path: Path) -> None:
    ckpts, image = run_root / "checkpoints", tmp_path / "checkpoints.img"
    ckpts.mkdir(parents=True)
    subprocess.run(["truncate", "-s", "64M", str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", str(image)], check=True, capture_output=True)
    p = subprocess.run(["mount", "-o", "loop", str(image), str(ckpts)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot loop-mount an ext4 image here (needs root and /dev/loop*): {p.stderr.strip()}")
    frozen, held_s = False, 1.5 * SHORT_HANG_S
    try:
        job = submit(run_root, f"failure.hang_timeout_s={SHORT_HANG_S}", steps=FINAL_STEPS)
        wait_for_step(run_root, FINAL_STEPS - 10)
        # Every write to the checkpoints now blocks in the kernel (a parallel filesystem that stopped
        # answering): the final save at step FINAL_STEPS cannot finish until thawed.
        subprocess.run(["fsfreeze", "-f", str(ckpts)], check=True, timeout=30)
        frozen = True
        time.sleep(held_s)
        phases = {json.loads((run_root / f"heartbeats/{job}.0/rank{r}.json").read_text())["phase"] for r in (0, 1)}
        subprocess.run(["fsfreeze", "-u", str(ckpts)], check=True, timeout=30)
        frozen = False
        recs = wait_job_done(job)
        assert phases <= {"checkpoint_save", "checkpoint_wait"}, phases
        assert _states(recs) == ["COMPLETED"], recs
        assert not events(run_root, "failure") and not events(run_root, "decision")
        final = [e for e in events(run_root, "checkpoint_saved") if e["step"] == FINAL_STEPS]
        assert len(final) == 1 and final[0]["total_s"] > SHORT_HANG_S, final
        assert (ckpts / f"step_{FINAL_STEPS}/manifest.json").exists()
        assert not (ckpts / f"step_{FINAL_STEPS}.tmp").exists()
        assert losses(run_root).keys() == set(range(1, FINAL_STEPS + 1))
    finally:
        if frozen:
            subprocess.run(["fsfreeze", "-u", str(ckpts)], check=False, timeout=30)
        subprocess.run(["umount", "-l", str(ckpts)], check=False)


def test_a_rank_whose_failure_path_cannot_write_exits_and_the_supervisor_decides_in_its_place(run_root: Path) -> None:
    incidents = run_root / "incidents"
    incidents.mkdir(parents=True)
    # Stacks, incident, claim and decision all go here: the failure path meets a read-only disk.
    p = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(incidents)], capture_output=True, text=True
    )
    if p.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here (needs root / CAP_SYS_ADMIN): {p.stderr.strip()}")
    job = None
    try:
        job = submit(run_root, "failure.missed_beats=3", f"failure.hang_timeout_s={SHORT_HANG_S}", steps=SHORT_STEPS)
        wait_for_step(run_root, SHORT_FAULT_STEP)
        pid = rank_pid(run_root, f"{job}.0", 1)
        os.kill(pid, signal.SIGSTOP)
        # rank 0 names the hang in seconds, cannot write anything of it (EROFS) and exits 75 anyway; no
        # decision comes, so the supervisor ends the step one hang timeout after srun reported the exit and
        # decides in the ranks' place, with their policy: a restart inside the allocation, which finishes the
        # run (before: the job ended FAILED there, the run lost; before that, it waited for its time limit).
        recs = wait_job_done(job)
        assert _states(recs) == ["COMPLETED"], recs
        (failure,) = events(run_root, "failure")
        assert failure["cls"] == "dead_rank" and failure["reported_by"] == -1 and failure["suspects"] == [], failure
        assert "task 0: Exited with exit code 75" in failure["summary"], failure
        assert [(e["attempt"], e["action"]) for e in events(run_root, "decision")] == [(f"{job}.0", "restart")]
        assert losses(run_root).keys() == set(range(1, SHORT_STEPS + 1))
        log = "".join(f.read_text() for f in (run_root / "slurm").rglob("*_log.*"))
        assert "and no decision 10 s later" in log and f"decision of attempt {job}.0 not published" in log
        assert list(incidents.iterdir()) == []
    finally:
        if (
            job is not None
            and subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip()
        ):
            subprocess.run(["scancel", job], check=False)
        subprocess.run(["umount", "-l", str(incidents)], check=False)
