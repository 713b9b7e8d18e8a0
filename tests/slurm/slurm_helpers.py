"""Helpers of the slurm tier: run the CLIs as a login-node user would, and read what sacct/scontrol report."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from jobs.launch.slurm_state import ACTIVE_STATES, job_state

REPO = Path(__file__).resolve().parents[2]
# A REQUEUED record is final: the attempt after it has its own record. So is a RESIZING one: the allocation until
# Slurm took a failed node out of a --no-kill job (with its End); the rest of the job has its own record.
FINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "OUT_OF_MEMORY",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "REQUEUED",
    "RESIZING",
}


def cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """Runs `python -m ARGS...` from the repo root, as a user on the login node would."""
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def submitted_job_id(text: str, pattern: str = r"submitted job (\d+)") -> str:
    m = re.search(pattern, text)
    assert m, f"no job id in output:\n{text}"
    return m.group(1)


def sacct(job_id: str, *, steps: bool = False) -> list[dict[str, str]]:
    """sacct's records for a job (array elements included), one dict per line."""
    cols = "JobID,JobIDRaw,State,ExitCode,NodeList,NNodes,NTasks"
    cmd = ["sacct", "-n", "-P", "--duplicates", "-o", cols, "-j", job_id] + ([] if steps else ["-X"])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return [dict(zip(cols.split(","), line.split("|"))) for line in out.splitlines() if line.strip()]


def wait_final(job_id: str, *, count: int = 1, timeout: float = 360) -> list[dict[str, str]]:
    """Polls sacct (4 times a second) until `count` allocation records of the job are in a final state; returns them."""
    deadline = time.monotonic() + timeout
    recs: list[dict[str, str]] = []
    while time.monotonic() < deadline:
        recs = [r for r in sacct(job_id) if "[" not in r["JobID"]]
        if len(recs) >= count and all(r["State"].split()[0] in FINAL for r in recs):
            return recs
        time.sleep(0.25)  # sacct answers in ~0.1 s (loaded box): an end is seen within 0.35 s
    raise AssertionError(f"job {job_id} not finished after {timeout} s: {recs}")


def wait_ended(job_id: str, *, timeout: float = 120) -> None:
    """Polls the controller until the job is in none of Slurm's active states: sacct may record CANCELLED while
    scontrol still shows COMPLETING (the epilog and the ranks' teardown), and the product counts that as live."""
    deadline = time.monotonic() + timeout
    while (state := job_state(job_id).state) in ACTIVE_STATES:
        assert time.monotonic() < deadline, f"job {job_id} still {state} after {timeout} s"
        time.sleep(0.25)


def scontrol_job(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, check=True)
    return dict(kv.split("=", 1) for kv in out.stdout.split() if "=" in kv)


def next_job_id() -> int:
    """Submits a no-op job and returns its id: two calls bracket what was submitted in between."""
    out = subprocess.run(
        ["sbatch", "--parsable", "-o", "/dev/null", "--wrap", "true"],
        capture_output=True,
        text=True,
        check=True,
        cwd="/tmp",
    )
    return int(out.stdout.strip().split(";")[0])


def jobs_submitted_between(before: int, after: int) -> list[str]:
    """Jobs (or arrays) submitted strictly between two `next_job_id()` marks; array elements of older arrays,
    which take fresh ids when they start, are not counted."""
    out = subprocess.run(
        ["sacct", "-n", "-P", "-X", "-a", "-S", "now-1hour", "-o", "JobID"], capture_output=True, text=True, check=True
    ).stdout
    ids = {line.split("_")[0] for line in out.split()}
    return sorted(i for i in ids if i.isdigit() and before < int(i) < after)
