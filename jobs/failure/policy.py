"""The policy: after a stop signal or an incident, requeue the job or stop it for good, within budgets.

Exactly one process decides per attempt: the first to claim `incidents/<attempt>/decision.json`
(an O_EXCL create on the shared run dir, so it works across nodes and when rank 0 is the one that
died). The decider writes the ledger records, runs `scontrol requeue` *before* any rank tears down,
and only then publishes the decision file (its exit code for the other ranks, the supervisor's cue to
end the step): a step, and the batch script after it, that ended on a published "requeue" before the
requeue reached Slurm would end the job instead.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from jobs import exitcodes
from jobs.config import FailureConfig
from jobs.failure.incident import REQUEUE_CLASSES, RESTART_CLASSES, incident_dir
from jobs.failure.ledger import attempts, attempts_without_progress
from jobs.failure.quarantine import QUARANTINE_CLASSES, scontrol
from jobs.failure.spares import swap
from jobs.launch.slurm_state import job_state
from jobs.records import load_json, stamped

__all__ = [
    "Decision",
    "Restart",
    "decide",
    "claim",
    "claimant",
    "publish",
    "read_decision",
    "decision_wait_s",
    "requeue_job",
    "requeues_used",
    "slurm_intent",
    "stop_notice",
    "suspects_again",
]

_SLURM_CALLS_S = 20.0  # what the decider's Slurm calls (sinfo, requeue, update) take on a healthy controller


@dataclass
class Restart:
    """What decides between a restart inside the allocation and a requeue."""

    supervised: bool  # a supervisor will start the ranks again (jobs.launch.supervise, the local launcher)
    used: int  # restarts inside this allocation so far
    bad_nodes: list[str]  # suspects' nodes that do not answer, or were named by an earlier incident of the run
    # the allocation's idle spare nodes (jobs.failure.spares); None when the job has none (launcher.spare_nodes=0)
    spares: list[str] | None = None

    @property
    def swappable(self) -> bool:
        """Bad nodes that the spares left can all replace: a restart inside the allocation without them."""
        return bool(self.bad_nodes) and swap(self.bad_nodes, self.spares) is not None


@dataclass
class Decision:
    action: str  # restart (inside the allocation) | requeue | stop | requeued_by_slurm | none (being cancelled)
    reason: str
    exit_code: int
    requeues_used: int
    max_requeues: int
    attempts_without_progress: int
    excluded: list[str] = field(default_factory=list)  # the nodes a requeue excludes (the quarantine list)
    free: bool = False  # a requeue that failure.max_requeues does not count: a stop notice after committed progress


def requeues_used(events: list[dict], *, restart_count: int) -> int:
    """Requeues that count against failure.max_requeues so far: Slurm's restart count of this job (it also
    counts Slurm's own and an admin's requeues) or the run's ledger (it also counts earlier jobs of the same run
    dir), the larger; either without the free ones (`Decision.free`: a time limit or a preemption after
    committed progress, as submitit spends its countdown on timeouts only)."""
    decisions = [e for e in events if e.get("kind") == "decision"]
    free = sum(1 for e in decisions if e.get("free") and e.get("action") in ("requeue", "requeued_by_slurm"))
    ours = sum(1 for e in decisions if e.get("action") == "requeue" and not e.get("free"))
    return max(restart_count - free, ours)


def stop_notice(cause: str) -> bool:
    """A cause that is a stop notice (the time limit's or a preemption's signal), not a fault."""
    return cause.startswith("SIG") or cause in ("stop_signal", "preempted", "walltime")


# scontrol's Reason of a job whose batch script ended by itself with an error (Slurm 22.05 FAIL_EXIT_CODE,
# FAIL_LAUNCH: the batch shell killed by a signal, FAIL_OOM); scancel leaves None, the time limit TimeLimit.
_BATCH_FAILED = frozenset({"NonZeroExitCode", "JobLaunchFailure", "OutOfMemory"})


def slurm_intent(job_id: str | None, *, restart_count: int) -> str | None:
    """What Slurm is already doing with this job while its ranks got SIGTERM: "requeued" (an admin's
    `scontrol requeue` or a preemption requeue: Restarts is already past ours), "supervisor_died" (the
    batch step, where the supervisor runs, ended with an error while the ranks ran: kill -9, the OOM
    killer; Slurm ends the job, nobody cancelled it), "cancelled" (scancel or the time limit: the job
    is COMPLETING/CANCELLED/TIMEOUT without a new restart), else None."""
    if not job_id:
        return None
    js = job_state(job_id)
    if js.restarts > restart_count:
        return "requeued"
    if js.state == "COMPLETING" and js.reason in _BATCH_FAILED:
        return "supervisor_died"
    if js.state in ("COMPLETING", "CANCELLED", "TIMEOUT", "DEADLINE"):
        return "cancelled"
    return None


def decide(
    events: list[dict],
    *,
    cause: str,
    cfg: FailureConfig,
    restart_count: int,
    slurm: str | None = None,
    restart: Restart | None = None,
    suspect_nodes: list[str] | None = None,
) -> Decision:
    """Restart inside the allocation for a dead or hung rank whose node still answers, within
    failure.restarts_in_allocation; else requeue for a stop signal or a class a fresh start can cure,
    unless the requeue budget or the no-progress breaker says stop; stop at once for anything else
    (a bug fails the same way again). `slurm` (from `slurm_intent`): Slurm already requeues the job,
    or is cancelling it (not undone), or ends it because the supervisor died (a stop signal then
    becomes the cause `supervisor_died`, requeued within the budget). `suspect_nodes`: the incident's
    suspects' nodes; when the breaker trips on a node-pointing incident (`QUARANTINE_CLASSES`) whose
    node was a suspect of an earlier attempt of the same fruitless run, the job is requeued without it
    instead (a device that hangs passes the node probe, and restarts on it count toward the breaker).
    Bad nodes (`restart.bad_nodes`) that the allocation's spares can replace restart inside it, any
    node-pointing class included (an unhealthy GPU, SDC); without enough spares they are requeued without."""
    if cause == "supervisor_died" or slurm == "supervisor_died" and (cause.startswith("SIG") or cause == "stop_signal"):
        cause = "supervisor_died"  # nobody will start the ranks again: only a requeue brings the job back
    used = requeues_used(events, restart_count=restart_count)
    fruitless = attempts_without_progress(events)
    free = stop_notice(cause) and fruitless == 0 and not _failed(events)  # a checkpoint committed, no fault seen
    facts = dict(requeues_used=used, max_requeues=cfg.max_requeues, attempts_without_progress=fruitless, free=free)
    settled = _settled(cause, slurm, facts)
    if settled is not None:
        return settled
    cls = cause
    if restart is not None and restart.supervised and (cause in RESTART_CLASSES or restart.swappable):
        if fruitless < cfg.max_attempts_without_progress:
            why = _no_restart(restart, cfg)
            if why is None:
                return _restart_inside(cause, restart, cfg, facts)
            cause = f"{cause} ({why})"
    return _requeue_or_stop(events, cause, cls=cls, cfg=cfg, facts=facts, suspect_nodes=suspect_nodes or [])


def _settled(cause: str, slurm: str | None, facts: dict) -> Decision | None:
    """The decisions that neither a restart nor the budget can change: Slurm requeues or cancels the job already,
    or the cause is not one a fresh start cures."""
    if slurm == "requeued":
        return Decision(
            "requeued_by_slurm", f"{cause}: Slurm is requeueing the job already", exitcodes.REQUEUE, **facts
        )
    if slurm == "cancelled":
        return Decision(
            "none",
            f"{cause}: the job is being cancelled (scancel or time limit); not requeued",
            exitcodes.REQUEUE,
            **facts,
        )
    if cause not in REQUEUE_CLASSES and not stop_notice(cause) and cause != "supervisor_died":
        code = {
            "config_error": exitcodes.CONFIG_ERROR,
            "loss_spike": exitcodes.DIVERGED,
            "non_finite_loss": exitcodes.DIVERGED,
        }.get(cause, exitcodes.FAILED)
        return Decision("stop", f"{cause} is not cured by a restart", code, **facts)
    return None


def _restart_inside(cause: str, restart: Restart, cfg: FailureConfig, facts: dict) -> Decision:
    pairs = swap(restart.bad_nodes, restart.spares) or {}
    swapped = "".join(f"; node {b} replaced by spare node {s}" for b, s in pairs.items())
    return Decision(
        "restart",
        f"{cause}: restart {restart.used + 1} of failure.restarts_in_allocation"
        f"({cfg.restarts_in_allocation}) inside the allocation{swapped}",
        exitcodes.REQUEUE,
        **facts,
    )


def _requeue_or_stop(
    events: list[dict], cause: str, *, cls: str, cfg: FailureConfig, facts: dict, suspect_nodes: list[str]
) -> Decision:
    """A requeue, free after committed progress, else within failure.max_requeues and the no-progress breaker
    (which requeues without a node that was a suspect before, rather than stop); else a stop."""
    used, fruitless = facts["requeues_used"], facts["attempts_without_progress"]
    if facts["free"]:
        return Decision(
            "requeue",
            f"{cause}: requeue after committed progress, not counted against failure.max_requeues"
            f"({cfg.max_requeues}) ({used} counted so far)",
            exitcodes.REQUEUE,
            **facts,
        )
    if used >= cfg.max_requeues:
        return Decision(
            "stop",
            f"requeue budget spent: {used} requeues >= failure.max_requeues({cfg.max_requeues})",
            exitcodes.STOPPED,
            **facts,
        )
    if fruitless >= cfg.max_attempts_without_progress:
        again = suspects_again(events, suspect_nodes) if cls in QUARANTINE_CLASSES else []
        if again:
            return Decision(
                "requeue",
                f"{cause}: suspect node {', '.join(again)} again after {fruitless} attempts "
                f"without a new checkpoint: requeue {used + 1} of failure.max_requeues({cfg.max_requeues}) "
                f"without it instead of the stop failure.max_attempts_without_progress"
                f"({cfg.max_attempts_without_progress}) calls for",
                exitcodes.REQUEUE,
                **facts,
            )
        return Decision(
            "stop",
            f"{fruitless} attempts in a row committed no new checkpoint >= "
            f"failure.max_attempts_without_progress({cfg.max_attempts_without_progress})",
            exitcodes.STOPPED,
            **facts,
        )
    return Decision(
        "requeue",
        f"{cause}: requeue {used + 1} of failure.max_requeues({cfg.max_requeues})",
        exitcodes.REQUEUE,
        **facts,
    )


def _failed(events: list[dict]) -> bool:
    """Whether the newest attempt recorded a failure (the guard's `supervisor_died` before the USR2 it sends)."""
    every = attempts(events)
    newest = every[-1].attempt if every else None
    return any(e.get("kind") == "failure" and e.get("attempt") == newest for e in events)


def suspects_again(events: list[dict], nodes: list[str]) -> list[str]:
    """Those of `nodes` that a node-pointing incident (`QUARANTINE_CLASSES`) of an earlier attempt of the
    current no-progress streak named as a suspect (the newest attempt, the one being decided, is left out)."""
    every = attempts(events)
    streak = every[len(every) - attempts_without_progress(events) :]
    earlier = {a.attempt for a in streak[:-1]}
    named = {
        s.get("node")
        for e in events
        if e.get("kind") == "failure" and e.get("attempt") in earlier and e.get("cls") in QUARANTINE_CLASSES
        for s in e.get("suspects") or []
    }
    return sorted(set(nodes) & named)


def decision_wait_s(cfg: FailureConfig) -> float:
    """How long a rank that did not decide waits for the decision: the decider settles the incident (up to
    3.5 heartbeats), probes the suspects' nodes and asks Slurm, then publishes. Past it the rank exits 75."""
    return 5 * cfg.heartbeat_s + cfg.node_probe_timeout_s + _SLURM_CALLS_S


def _no_restart(restart: Restart, cfg: FailureConfig) -> str | None:
    """Why this failure goes back to the queue instead of restarting in place (None: restart)."""
    if restart.bad_nodes and not restart.swappable:
        left = "" if restart.spares is None else f", no spare node left to replace it ({len(restart.spares)} idle)"
        return f"suspect node {', '.join(restart.bad_nodes)}: requeue without it{left}"
    if restart.used >= cfg.restarts_in_allocation:
        return f"failure.restarts_in_allocation({cfg.restarts_in_allocation}) spent"
    return None


def claim(run_dir: str | os.PathLike[str], attempt: str, *, rank: int | None = None) -> bool:
    """True for exactly one caller per attempt (the decider); the claim names it (rank, pid, host), so that
    the supervisor can name a decider that died before publishing (`claimant`)."""
    folder = incident_dir(run_dir, attempt)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(folder / ".claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, json.dumps({"rank": rank, "pid": os.getpid(), "host": os.uname().nodename}).encode())
    finally:
        os.close(fd)
    return True


def claimant(run_dir: str | os.PathLike[str], attempt: str) -> dict | None:
    """Who claimed the attempt's decision ({rank, pid, host}; {} for a claim that names nobody); None if
    nobody did."""
    try:
        text = (incident_dir(run_dir, attempt) / ".claim").read_text()
    except OSError:  # none there, or its folder cannot be read (nor written: no claim could be made)
        return None
    try:
        return json.loads(text)
    except ValueError:  # empty: claimed, not yet named (or by a version that did not name it)
        return {}


def publish(run_dir: str | os.PathLike[str], attempt: str, decision: Decision) -> None:
    path = incident_dir(run_dir, attempt) / "decision.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(".decision.json.tmp")
    tmp.write_text(json.dumps(stamped({**asdict(decision), "time": time.time()})))
    os.replace(tmp, path)


def read_decision(run_dir: str | os.PathLike[str], attempt: str, *, wait_s: float) -> dict | None:
    """The decider's published decision, waiting up to `wait_s` for it."""
    path = Path(incident_dir(run_dir, attempt)) / "decision.json"
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return load_json(path)
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                return None
            time.sleep(0.2)


def requeue_job(job_id: str) -> tuple[bool, str]:
    """`scontrol requeue JOB` (an array element as ARRAY_TASK), tried again while slurmctld does not answer;
    (ok, what scontrol said)."""
    return scontrol(["requeue", job_id])
