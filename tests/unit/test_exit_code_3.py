"""Exit code 3 (jobs/exitcodes.py ENV_ERROR): the login node's environment cannot submit the job: no `sbatch`
on PATH, sbatch refusing the job, or (launcher.wait) Slurm no longer knowing it. Runs without a cluster:
PATH holds no sbatch, or a stand-in that refuses as a real one does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from jobs import exitcodes
from jobs.launch.slurm_state import JobState, exit_code_of

REPO = Path(__file__).resolve().parents[2]
REFUSAL = "sbatch: error: Batch job submission failed: Invalid account or account/partition combination specified"


def _submit(tmp_path: Path, path: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": path}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "jobs.train",
            "launcher=slurm",
            f"cluster.run_root={tmp_path}",
            f"run.dir={tmp_path / 'run'}",
            "train.steps=2",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_no_sbatch_on_path_exits_3_naming_it_before_the_run_dir_is_written(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    r = _submit(tmp_path, str(empty))
    assert r.returncode == exitcodes.ENV_ERROR == 3, r.stderr
    assert "error: sbatch not found on PATH" in r.stderr and "scripts/slurm/start" in r.stderr
    assert not (tmp_path / "run").exists()


def test_sbatch_refusing_the_job_exits_3_with_its_message_and_keeps_the_run_dir(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "sbatch"
    fake.write_text(f"#!/bin/sh\necho '{REFUSAL}' >&2\nexit 1\n")
    fake.chmod(0o755)
    r = _submit(tmp_path, f"{bin_dir}:/usr/bin:/bin")
    assert r.returncode == 3, r.stderr
    assert f"error: sbatch refused the job (run dir {tmp_path / 'run'} kept): {REFUSAL}" in r.stderr
    assert (tmp_path / "run" / "config.yaml").exists()  # what was submitted stays for the user to look at
    assert "submitted job" not in r.stdout


def test_a_waited_for_job_slurm_no_longer_knows_is_exit_3_and_never_ok() -> None:
    assert exit_code_of(JobState("77", "UNKNOWN")) == 3
    assert (exit_code_of(JobState("77", "COMPLETED")), exit_code_of(JobState("77", "PREEMPTED"))) == (0, 75)
