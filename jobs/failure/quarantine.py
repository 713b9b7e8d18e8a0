"""Bad nodes: asking whether a node still answers, the run's quarantine list, and a requeue that avoids them.

`RUN_DIR/quarantine.json` is a list of {node, reason, incident, time, evidence}; it only grows, survives
requeues (it lives in the run dir) and every requeue this run makes excludes all of it. Only incidents
that point at a node go on it (`QUARANTINE_CLASSES`): a dead or hung rank, an unhealthy GPU, a straggler,
silent data corruption; never a full shared disk or the arbitrary minority of a mismatch. Slurm refuses
`ExcNodeList` on a running job, but accepts it from the moment `scontrol requeue` returns (the job is then
PENDING|COMPLETING until its last process exits, and waits cred_expire+1 s more): so the exclusion is
`requeue` -> `update ExcNodeList=`, never a hold that a failed or killed caller could leave in place.
A node "answers" when a one-task step on it (`srun --overlap` inside the job's own allocation) runs
`true` within `failure.node_probe_timeout_s`: that exercises the node's slurmd and its ability to start
a process, which Slurm's own node state only learns after SlurmdTimeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from jobs.events import exclusive
from jobs.log import get_logger

__all__ = [
    "QUARANTINE_CLASSES",
    "quarantined",
    "add_to_quarantine",
    "node_answers",
    "probe_node",
    "probe_nodes",
    "controller_answers",
    "known_nodes",
    "usable_nodes",
    "requeue_excluding",
    "scontrol",
]

# Incident classes whose suspects' nodes are quarantined when the job is requeued: the ones whose evidence
# points at a node. `sdc`: silent data corruption (a recomputed step that differs on one rank's node).
QUARANTINE_CLASSES = frozenset({"dead_rank", "hung_rank", "unhealthy_gpu", "straggler", "sdc"})

_STEP_VARS = (
    "SLURM_STEP_ID",
    "SLURM_STEPID",
    "SLURM_NTASKS",
    "SLURM_NPROCS",
    "SLURM_NNODES",
    "SLURM_NODELIST",
    "SLURM_STEP_NODELIST",
    "SLURM_STEP_NUM_NODES",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_TASKS_PER_NODE",
    "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_DISTRIBUTION",
    "SLURM_SRUN_COMM_PORT",
)


def _path(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / "quarantine.json"


def quarantined(run_dir: str | os.PathLike[str], *, ttl_h: float = 0.0) -> list[dict]:
    """The run's quarantine list ([] when there is none), without the entries listed more than `ttl_h` hours ago
    (failure.quarantine_ttl_h; 0: none expire; an entry without a time does not). The file is edited by hand too: what cannot be read
    (not JSON, not a list, an entry without a node name) is left out with a warning that names the file and the
    fix, never raised (the decision path reads it before `scontrol requeue`); a bare node name (`["node3"]`) is
    taken as that node."""
    path = _path(run_dir)
    try:
        listed = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        _bad_quarantine(path, f"cannot be read ({e}); no node is excluded by it")
        return []
    if not isinstance(listed, list):
        _bad_quarantine(path, f"holds a {type(listed).__name__}, not a list; no node is excluded by it")
        return []
    entries, bare, skipped = [], [], []
    for e in listed:
        if isinstance(e, str) and e:
            entries.append({"node": e, "reason": "listed by hand"})
            bare.append(e)
        elif isinstance(e, dict) and isinstance(e.get("node"), str) and e["node"]:
            entries.append(e)
        else:
            skipped.append(e)
    if skipped or bare:
        said = [f"bare node name(s) {', '.join(bare)} taken as quarantined"] if bare else []
        said += [f"entries without a node name left out: {json.dumps(skipped, default=str)[:200]}"] if skipped else []
        _bad_quarantine(path, "; ".join(said))
    return [e for e in entries if not _expired(e, ttl_h)]


def _expired(entry: dict, ttl_h: float) -> bool:
    t = entry.get("time")
    return bool(ttl_h) and isinstance(t, int | float) and time.time() - t > ttl_h * 3600


def _bad_quarantine(path: Path, what: str) -> None:
    get_logger().warning(
        "%s %s: write it as a JSON list of objects, one per node, e.g. "
        '[{"node": "node3", "reason": "bad DIMM"}], or delete it to exclude no node',
        path,
        what,
    )


def add_to_quarantine(
    run_dir: str | os.PathLike[str],
    nodes: list[str],
    *,
    reason: str,
    incident: str,
    evidence: dict[str, dict] | None = None,
    ttl_h: float = 0.0,
) -> list[dict]:
    """Adds the nodes not yet on the list, or whose entry expired (`ttl_h`), each with its `evidence[node]` when
    given (temp file + rename, read and written under `exclusive`: deciders and straggler checks on several hosts
    may add at once); returns the whole list."""
    with exclusive(_path(run_dir)):
        return _add(run_dir, nodes, reason=reason, incident=incident, evidence=evidence, ttl_h=ttl_h)


def _add(
    run_dir: str | os.PathLike[str],
    nodes: list[str],
    *,
    reason: str,
    incident: str,
    evidence: dict[str, dict] | None,
    ttl_h: float,
) -> list[dict]:
    entries = [e for e in quarantined(run_dir) if not (e["node"] in nodes and _expired(e, ttl_h))]
    known = {e["node"] for e in entries}
    entries += [
        {
            "node": n,
            "reason": reason,
            "incident": incident,
            "time": time.time(),
            **({"evidence": evidence.get(n, {})} if evidence is not None else {}),
        }
        for n in dict.fromkeys(nodes)
        if n and n not in known
    ]
    path = _path(run_dir)
    tmp = path.with_name(f".{path.name}.{os.uname().nodename}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(entries, indent=1, default=str))
    os.replace(tmp, path)
    return entries


# srun's words when it is slurmctld that did not answer (busy, restarting, unreachable), not the node: such a probe
# says nothing about the node (slurm 22.05: src/common/slurm_protocol_api.c, src/api/step_ctx.c). A communication
# error counts only at step creation (slurmctld's part: "Unable to create step", or, before it, "Unable to confirm
# allocation", what 22.05's srun says inside a job when slurmctld stays silent past MessageTimeout); at task launch
# ("Task launch for StepId=... failed on node X: ...") it is the node's slurmd that did not answer. `scontrol
# requeue` words slurmctld's silence past MessageTimeout "Unexpected message received for job N" (22.05.8, seen with
# slurmctld SIGSTOPped), and slurmctld may still carry the request out once it reads it.
_CONTROLLER = ("Unable to contact slurm controller", "temporarily unable to accept", "Unexpected message received")
_STEP_CREATION = ("Unable to create step", "Unable to confirm allocation", "slurm_")
_COMM_ERRORS = (
    "Socket timed out",
    "Zero Bytes were transmitted",
    "Connection refused",
    "Connection timed out",
    "Transport endpoint is not connected",
)


def _controller_failed(text: str) -> bool:
    """Whether srun's or scontrol's words say that slurmctld, not the node, did not answer."""
    return any(
        any(c in line for c in _CONTROLLER)
        or (any(c in line for c in _STEP_CREATION) and any(c in line for c in _COMM_ERRORS))
        for line in text.splitlines()
    )


def probe_node(job_id: str, node: str, *, timeout_s: float) -> tuple[str, str]:
    """("answers" | "silent" | "unknown", what was seen): "answers" when a one-task step of `job_id` runs on `node`
    within `timeout_s` (its slurmd answers and starts processes); "silent" when it did not while slurmctld answers
    (`scontrol ping`); "unknown" when srun's failure was slurmctld's (busy, unreachable: `_controller_failed`),
    which is no evidence against the node. Called from inside a step, so that step's variables are dropped first."""
    env = {k: v for k, v in os.environ.items() if k not in _STEP_VARS}
    # --mem=0: the ranks' step holds all of the job's memory, and a step asking for any is refused
    # ("Memory required by task is not available") however healthy the node is.
    cmd = [
        "srun",
        f"--jobid={os.environ.get('SLURM_JOB_ID') or job_id}",
        "--overlap",
        "--mem=0",
        "-N1",
        "-n1",
        "--job-name=meshjob-probe",
        f"-w{node}",
        "--quiet",
        "--kill-on-bad-exit=1",
        "true",
    ]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        said = f"no one-task step ran on it within failure.node_probe_timeout_s({timeout_s}) ({e})"
    else:
        if out.returncode == 0:
            return "answers", "a one-task step ran on it"
        said = f"srun exited {out.returncode}: {out.stderr.strip()}"
        if _controller_failed(out.stderr):
            return _unknown(node, said)
    if not controller_answers():
        return _unknown(node, f"{said}; slurmctld does not answer `scontrol ping` either")
    get_logger().warning("node %s does not answer: %s", node, said)
    return "silent", said


def _unknown(node: str, said: str) -> tuple[str, str]:
    get_logger().warning("node %s not judged: slurmctld did not answer (%s)", node, said)
    return "unknown", f"not judged, slurmctld did not answer: {said}"


def controller_answers(timeout_s: float = 10.0) -> bool:
    """Whether slurmctld answers `scontrol ping` with UP within `timeout_s`."""
    try:
        out = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and " is UP" in out.stdout


def probe_nodes(job_id: str, nodes: list[str], *, timeout_s: float) -> dict[str, tuple[str, str]]:
    """`probe_node` for every node at once (8 lost nodes take one timeout, not eight)."""
    nodes = list(dict.fromkeys(nodes))
    if not nodes:
        return {}
    with ThreadPoolExecutor(max_workers=min(len(nodes), 32), thread_name_prefix="probe") as pool:
        futures = {n: pool.submit(probe_node, job_id, n, timeout_s=timeout_s) for n in nodes}
    return {n: f.result() for n, f in futures.items()}


def node_answers(job_id: str, node: str, *, timeout_s: float) -> bool:
    """False only when the node did not run a one-task step while slurmctld answers (`probe_node`)."""
    return probe_node(job_id, node, timeout_s=timeout_s)[0] != "silent"


def _sinfo(args: list[str]) -> str | None:
    """stdout of `sinfo -h ARGS`; None when Slurm cannot answer (no sinfo, a timeout, a non-zero exit)."""
    try:
        out = subprocess.run(["sinfo", "-h", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def known_nodes() -> set[str] | None:
    """Every node name Slurm knows (all partitions, hidden ones included); None when it cannot say."""
    out = _sinfo(["-a", "-N", "-o", "%N"])
    return None if out is None else set(out.split())


def usable_nodes(partition: str | None, excluded: set[str]) -> list[str] | None:
    """The partition's nodes (the default partition's when None) that are neither down, drained, failing
    nor excluded; None when sinfo cannot say (a busy or restarting controller is no reason to stop)."""
    out = _sinfo(["-N", "-o", "%N %t", *(["-p", partition] if partition else [])])
    if out is None:
        return None
    bad = ("down", "drain", "drng", "fail", "maint", "no_resp", "npc", "unk")
    nodes = {}
    for line in out.splitlines():
        name, state = line.split()[:2]
        nodes[name] = not any(state.rstrip("*~#!%$@^-").startswith(b) for b in bad) and not state.endswith("*")
    return sorted(n for n, ok in nodes.items() if ok and n not in excluded)


def _ignore_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


# `scontrol` tries: a failure in slurmctld's words (`_controller_failed`) or a timeout is tried again after these pauses
_RETRY_PAUSES_S = (1.0, 3.0, 9.0)


def _scontrol(args: list[str], said: list[str]) -> bool:
    """Runs `scontrol ARGS` ignoring SIGTERM (a requeue SIGTERMs every process of the job, the caller's
    scontrol calls included; the SIGKILL comes KillWait later), again after `_RETRY_PAUSES_S` while slurmctld
    does not answer (busy, restarting: a requeue that fails once must not end the job); appends what it said;
    True on rc 0, and for a requeue that a later try finds done (`_done_before`)."""
    unanswered = False  # an earlier try went unanswered: slurmctld may have carried it out all the same
    for pause in (*_RETRY_PAUSES_S, None):
        try:
            out = subprocess.run(
                ["scontrol", *args], capture_output=True, text=True, timeout=30, preexec_fn=_ignore_sigterm
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            said.append(f"scontrol {args[0]}: {e}")
            transient = isinstance(e, subprocess.TimeoutExpired)
        else:
            text = (out.stdout + out.stderr).strip()
            said.append(f"scontrol {args[0]}: rc {out.returncode} {text}".strip())
            if out.returncode == 0 or unanswered and _done_before(args, text, said):
                return True
            transient = _controller_failed(text)
        if not transient or pause is None:
            return False
        unanswered = True
        get_logger().warning("%s; trying again in %.0f s", said[-1], pause)
        time.sleep(pause)
    return False


def _done_before(args: list[str], text: str, said: list[str]) -> bool:
    """Whether a requeue refused as "Job is pending execution" after a try that went unanswered was that try's,
    carried out once slurmctld read it (the job is requeued: what was asked); noted in `said`."""
    if args[0] != "requeue" or "Job is pending execution" not in text:
        return False
    said.append("an earlier try reached slurmctld: the job is requeued")
    return True


def requeue_excluding(job_id: str, nodes: list[str]) -> tuple[bool, str]:
    """`scontrol requeue JOB`, then `scontrol update JobId=JOB ExcNodeList=` the nodes Slurm knows; returns
    (requeued, what was done and said). A name Slurm does not know (a node since removed) would make it
    refuse the whole list, so it is dropped first and named; when Slurm cannot list its nodes or still
    refuses, the job stays requeued with its previous exclusion (the supervisor of the next allocation
    requeues it again if that holds a quarantined node). Nothing here can leave the job held."""
    said: list[str] = []
    known = known_nodes()  # before the requeue: after it, this process has KillWait left
    names = list(dict.fromkeys(nodes)) if known is None else [n for n in dict.fromkeys(nodes) if n in known]
    if known is None:
        said.append("sinfo could not list the nodes: the exclusion is tried as is")
    elif len(names) < len(set(nodes)):
        unknown = [n for n in dict.fromkeys(nodes) if n not in known]
        said.append(f"dropped node(s) Slurm does not know: {', '.join(unknown)}")
    if not _scontrol(["requeue", job_id], said):
        return False, "; ".join(said)
    if nodes and not _scontrol(["update", f"JobId={job_id}", f"ExcNodeList={','.join(names)}"], said):
        said.append("requeued without the new exclusion")
    return True, "; ".join(said)


def scontrol(args: list[str]) -> tuple[bool, str]:
    """`_scontrol` for one call: (ok, what it said)."""
    said: list[str] = []
    return _scontrol(args, said), "; ".join(said)
