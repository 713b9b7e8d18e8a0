"""Bad nodes: asking whether a node still answers, the run's quarantine list, and a requeue that avoids them.

`RUN_DIR/quarantine.json` is a list of {node, reason, incident, time}; it only grows, survives
requeues (it lives in the run dir) and every requeue this run makes excludes all of it. Slurm
refuses `ExcNodeList` on a running job, so the exclusion is `scontrol requeuehold` -> `scontrol
update ExcNodeList=` -> `scontrol release`: the job cannot start again between the requeue and the
exclusion. A node "answers" when a one-task step on it (`srun --overlap` inside the job's own
allocation) runs `true` within `failure.node_probe_timeout_s`: that exercises the node's slurmd and
its ability to start a process, which Slurm's own node state only learns after SlurmdTimeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from jobs.log import get_logger

__all__ = ["quarantined", "add_to_quarantine", "node_answers", "usable_nodes", "requeue_excluding"]

_STEP_VARS = ("SLURM_STEP_ID", "SLURM_STEPID", "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NNODES", "SLURM_NODELIST",
              "SLURM_STEP_NODELIST", "SLURM_STEP_NUM_NODES", "SLURM_STEP_NUM_TASKS", "SLURM_TASKS_PER_NODE",
              "SLURM_STEP_TASKS_PER_NODE", "SLURM_DISTRIBUTION", "SLURM_SRUN_COMM_PORT")


def _path(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / "quarantine.json"


def quarantined(run_dir: str | os.PathLike[str]) -> list[dict]:
    """The run's quarantine list ([] when there is none)."""
    try:
        return json.loads(_path(run_dir).read_text())
    except FileNotFoundError:
        return []


def add_to_quarantine(run_dir: str | os.PathLike[str], nodes: list[str], *, reason: str, incident: str) -> list[dict]:
    """Adds the nodes not yet on the list (temp file + rename); returns the whole list."""
    entries = quarantined(run_dir)
    known = {e["node"] for e in entries}
    entries += [{"node": n, "reason": reason, "incident": incident, "time": time.time()}
                for n in dict.fromkeys(nodes) if n and n not in known]
    path = _path(run_dir)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entries, indent=1))
    os.replace(tmp, path)
    return entries


def node_answers(job_id: str, node: str, *, timeout_s: float) -> bool:
    """True when a one-task step of `job_id` runs on `node` within `timeout_s` (its slurmd answers and
    starts processes). Called from inside a step, so that step's variables are dropped first."""
    env = {k: v for k, v in os.environ.items() if k not in _STEP_VARS}
    # --mem=0: the ranks' step holds all of the job's memory, and a step asking for any is refused
    # ("Memory required by task is not available") however healthy the node is.
    cmd = ["srun", f"--jobid={os.environ.get('SLURM_JOB_ID') or job_id}", "--overlap", "--mem=0", "-N1", "-n1", "--job-name=meshjob-probe",
           f"-w{node}", "--quiet", "--kill-on-bad-exit=1", "true"]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        get_logger().warning("node %s does not answer: %s", node, e)
        return False
    if out.returncode != 0:
        get_logger().warning("node %s does not answer: srun exited %d: %s", node, out.returncode, out.stderr.strip())
    return out.returncode == 0


def usable_nodes(partition: str | None, excluded: set[str]) -> list[str]:
    """The partition's nodes (the default partition's when None) that are neither down, drained, failing
    nor excluded; [] when sinfo cannot say."""
    cmd = ["sinfo", "-h", "-N", "-o", "%N %t", *(["-p", partition] if partition else [])]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    bad = ("down", "drain", "drng", "fail", "maint", "no_resp", "npc", "unk")
    nodes = {}
    for line in out.splitlines():
        name, state = line.split()[:2]
        nodes[name] = not any(state.rstrip("*~#!%$@^-").startswith(b) for b in bad) and not state.endswith("*")
    return sorted(n for n, ok in nodes.items() if ok and n not in excluded)


def _ignore_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def requeue_excluding(job_id: str, nodes: list[str]) -> tuple[bool, str]:
    """Requeues `job_id` held, sets its ExcNodeList to `nodes` and releases it; (ok, what scontrol said).
    The hold makes Slurm SIGTERM every process of the job, the scontrol calls that follow included: they
    ignore SIGTERM (the SIGKILL comes KillWait later, long after they are done)."""
    said = []
    for args in (["requeuehold", job_id], ["update", f"JobId={job_id}", f"ExcNodeList={','.join(nodes)}"],
                 ["release", job_id]):
        try:
            out = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60,
                                 preexec_fn=_ignore_sigterm)
        except (OSError, subprocess.TimeoutExpired) as e:
            return False, "; ".join([*said, f"scontrol {args[0]}: {e}"])
        said.append(f"scontrol {args[0]}: rc {out.returncode} {(out.stdout + out.stderr).strip()}".strip())
        if out.returncode != 0:
            return False, "; ".join(said)
    return True, "; ".join(said)
