"""The Slurm-side view of a job (state, restarts, exit code, nodes) and the login-node wait on it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from jobs import exitcodes

__all__ = [
    "JobState",
    "ACTIVE_STATES",
    "FINAL_STATES",
    "SACCT_FIELDS",
    "parse_scontrol_job",
    "parse_sacct",
    "job_state",
    "sacct_attempts",
    "exit_code_of",
    "seconds_left",
    "wait_for_job",
]

# States of a job that may still run (Slurm 22.05 `job_state_string`: base states and the flags it shows
# instead of them). Anything else is an end; `wait_for_job` stops on it even when it is not in FINAL_STATES.
ACTIVE_STATES = frozenset(
    {
        "PENDING",
        "CONFIGURING",
        "RUNNING",
        "COMPLETING",
        "SUSPENDED",
        "STOPPED",
        "SIGNALING",
        "STAGE_OUT",
        "RESIZING",
        "REQUEUED",
        "REQUEUE_HOLD",
        "REQUEUE_FED",
        "SPECIAL_EXIT",
        "RESV_DEL_HOLD",
        "POWER_UP_NODE",
        "UPDATE_DB",
    }
)
# The ends Slurm 22.05 knows. PREEMPTED is final when the partition's PreemptMode is CANCEL (with REQUEUE
# the job shows COMPLETING/REQUEUED and then PENDING instead, and sacct keeps a PREEMPTED record).
FINAL_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "OUT_OF_MEMORY",
        "NODE_FAIL",
        "BOOT_FAIL",
        "DEADLINE",
        "PREEMPTED",
        "REVOKED",
    }
)
# One record per attempt with `sacct --duplicates -X` (sacct 22.05 has no Restarts field).
SACCT_FIELDS = ("JobID", "State", "ExitCode", "NodeList", "Start", "End", "Elapsed")
_REQUEUED_STATES = frozenset({"REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"})
_SCONTROL_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_/:]*)=")
_LOST_POLLS = 5  # consecutive polls where neither scontrol nor sacct knows the job before giving up


@dataclass(frozen=True, slots=True)
class JobState:
    job_id: str
    state: str  # base state word: RUNNING, CANCELLED (sacct's "CANCELLED by 0"), ...; UNKNOWN if not found
    exit_code: int = 0  # the batch script's exit status (ExitCode=code:signal)
    signal: int = 0  # the signal that ended it, 0 if none
    restarts: int = 0  # requeues so far: scontrol's Restarts, or sacct's attempts - 1
    nodes: str = ""  # hostlist of the (last) allocation, "" while pending
    reason: str = ""  # scontrol's Reason (BeginTime, NonZeroExitCode, None); "" from sacct
    source: str = ""  # "scontrol", "sacct", or "" when neither knows the job


def parse_scontrol_job(text: str) -> dict[str, str]:
    """The fields of the first job in `scontrol [-o] show job` output (one line or the indented form)."""
    record = re.split(r"\n(?=JobId=)", text.strip())[0]
    keys = list(_SCONTROL_KEY.finditer(record))
    ends = [m.start() for m in keys[1:]] + [len(record)]
    return {m[1]: record[m.end() : end].strip() for m, end in zip(keys, ends)}


def parse_sacct(text: str, fields: tuple[str, ...] = SACCT_FIELDS) -> list[dict[str, str]]:
    """The records of `sacct -n -P -o <fields>` output, one dict per line, keyed by field name."""
    records = []
    for line in text.splitlines():
        if not line.strip():
            continue
        values = line.split("|")
        if len(values) != len(fields):
            raise ValueError(f"sacct line {line!r} has {len(values)} fields, expected {len(fields)} ({fields})")
        records.append(dict(zip(fields, values)))
    return records


def _exit_pair(value: str) -> tuple[int, int]:
    code, _, sig = value.partition(":")
    return int(code or 0), int(sig or 0)


def _from_scontrol(job_id: str, fields: dict[str, str]) -> JobState:
    code, sig = _exit_pair(fields.get("ExitCode", "0:0"))
    return JobState(
        job_id,
        fields["JobState"],
        code,
        sig,
        int(fields.get("Restarts") or 0),
        fields.get("NodeList", ""),
        fields.get("Reason", ""),
        "scontrol",
    )


def _from_sacct(job_id: str, records: list[dict[str, str]]) -> JobState:
    last = records[-1]
    code, sig = _exit_pair(last["ExitCode"])
    state = last["State"].split()[0]  # "CANCELLED by 0" -> CANCELLED
    # Every attempt but the last was requeued; so was the last while it is REQUEUED (its rerun, pending, is
    # not in sacct yet).
    restarts = len(records) - 1 + (state in _REQUEUED_STATES)
    return JobState(job_id, state, code, sig, restarts, last["NodeList"], "", "sacct")


def _run(cmd: list[str]) -> str | None:
    """stdout of a Slurm command, None when it is missing or fails (unknown job, accounting off)."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def sacct_attempts(job_id: str, *, fields: tuple[str, ...] = SACCT_FIELDS) -> list[dict[str, str]]:
    """One record per attempt of the job (`sacct --duplicates -X`), oldest first; [] without accounting."""
    out = _run(["sacct", "-j", job_id, "--duplicates", "-X", "-n", "-P", "-o", ",".join(fields)])
    return parse_sacct(out, fields) if out else []


def job_state(job_id: str) -> JobState:
    """The job as Slurm sees it now: scontrol while the controller remembers it, then sacct's last attempt."""
    out = _run(["scontrol", "-o", "show", "job", job_id])
    fields = parse_scontrol_job(out) if out else {}
    if "JobState" in fields:
        return _from_scontrol(job_id, fields)
    attempts = sacct_attempts(job_id)
    return _from_sacct(job_id, attempts) if attempts else JobState(job_id, "UNKNOWN")


def seconds_left(job_id: str) -> float | None:
    """Seconds until the job's EndTime (its time limit) as slurmctld says now; None when it cannot say (no
    limit, an unknown job, no answer)."""
    out = _run(["scontrol", "-o", "show", "job", job_id])
    end = parse_scontrol_job(out).get("EndTime", "") if out else ""
    try:
        return time.mktime(time.strptime(end, "%Y-%m-%dT%H:%M:%S")) - time.time()
    except ValueError:  # Unknown, None, empty
        return None


def exit_code_of(js: JobState) -> int:
    """The meshjob exit code of an ended job: OK, REQUEUE when preempted for good, else its own code or FAILED."""
    if js.state == "COMPLETED":
        return exitcodes.OK
    if js.state == "PREEMPTED":
        return exitcodes.REQUEUE
    if js.state == "UNKNOWN":
        return exitcodes.ENV_ERROR
    return js.exit_code or exitcodes.FAILED


def _end_message(js: JobState, run_dir: Path) -> str:
    """What the user reads when the wait stops on anything but COMPLETED."""
    jid, logs = js.job_id, run_dir / "slurm" / js.job_id
    if js.state == "UNKNOWN":
        return (
            f"job {jid}: neither scontrol nor sacct knows it (gone from the controller after MinJobAge and "
            f"no accounting?); stopped following it; see {logs}"
        )
    if js.state == "PREEMPTED":
        return (
            f"job {jid} ended PREEMPTED and Slurm did not requeue it (partition PreemptMode=CANCEL?); "
            f"resubmit with run.dir={run_dir} to resume from its last checkpoint"
        )
    if js.state not in FINAL_STATES:
        return (
            f"job {jid} is in state {js.state}, which meshjob does not know; stopped following it "
            f"(check `sacct -j {jid} --duplicates`); see {logs}"
        )
    return f"job {jid} ended {js.state} with exit code {js.exit_code}:{js.signal}; see {logs}"


def _relay_metrics(path: Path, seen: int) -> int:
    """Prints the metrics lines after the first `seen`; returns how many are printed in all."""
    if not path.exists():
        return seen
    for line in path.read_text().splitlines()[seen:]:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            break  # a line being written; read it next time
        seen += 1
        print(
            "  " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items()), flush=True
        )
    return seen


def wait_for_job(job_id: str, run_dir: Path, *, poll_s: float = 2.0) -> int:
    """Follows a job until it ends, relaying state changes and metrics lines; returns an exit code."""
    seen, last, lost = 0, None, 0
    while True:
        js = job_state(job_id)
        if (js.state, js.restarts) != last:
            print(f"job {job_id}: {js.state}" + (f" (restart {js.restarts})" if js.restarts else ""), flush=True)
            last = (js.state, js.restarts)
        seen = _relay_metrics(run_dir / "metrics.jsonl", seen)
        lost = lost + 1 if js.state == "UNKNOWN" else 0
        if js.state not in ACTIVE_STATES and (js.state != "UNKNOWN" or lost >= _LOST_POLLS):
            if js.state != "COMPLETED":
                print(_end_message(js, run_dir), file=sys.stderr)
            return exit_code_of(js)
        time.sleep(poll_s)
