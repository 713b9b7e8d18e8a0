"""What a rank (or the local launcher) does when an attempt ends other than by finishing.

`on_failure`: dump this process's stacks, and if this process is the first to claim the attempt,
classify the incident from the heartbeats, write it, decide (requeue or stop) and act.
`conclude`: the decider's part, shared with the stop-signal path. `open_attempt`: the ledger's
record of a new attempt, writing the ends that the previous attempts could not write themselves.
`decide_for_lost_decider`: the supervisor's part when a step ended with its decision claimed and never
published; `decide_for_silent_attempt`: its part when a rank left and nobody could even claim the decision.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

from jobs import exitcodes
from jobs.config import FailureConfig
from jobs.events import EventLog, read_events
from jobs.failure.heartbeat import read_beats
from jobs.failure.incident import RESTART_CLASSES, Incident, classify_settled, dump_stacks, incident_dir, write_incident
from jobs.failure.ledger import render_summary, unfinished
from jobs.failure.policy import (
    Decision,
    Restart,
    claim,
    claimant,
    decide,
    decision_wait_s,
    publish,
    read_decision,
    requeue_job,
    requeues_used,
    slurm_intent,
    suspects_again,
)
from jobs.failure.quarantine import (
    QUARANTINE_CLASSES,
    add_to_quarantine,
    probe_nodes,
    quarantined,
    requeue_excluding,
    usable_nodes,
)
from jobs.failure.spares import spares_of, swap
from jobs.log import get_logger
from jobs.records import load_json

__all__ = [
    "AttemptContext",
    "on_failure",
    "conclude",
    "open_attempt",
    "decide_for_lost_decider",
    "decide_for_silent_attempt",
]

_once = threading.Lock()


@dataclass
class AttemptContext:
    """What the decider needs to know about the attempt it ends."""

    run_dir: str
    attempt: str
    rank: int  # -1 for the local launcher
    world_size: int
    job_id: str | None  # the Slurm job to requeue (ARRAY_TASK form); None locally
    restart_count: int
    cfg: FailureConfig
    events: EventLog
    supervised: bool = False  # a supervisor starts the ranks again after a "restart" decision
    restart_in_allocation: int = 0  # restarts inside this allocation before this attempt
    partition: str | None = None  # where a requeued job must find `nodes_needed` usable nodes
    nodes_needed: int = 1
    always_excluded: list[str] = field(default_factory=list)  # cluster.exclude, expanded: in every ExcNodeList
    pending_stop: Callable[[], str | None] | None = None  # the stop signal that arrived (its name), if any
    # run just before `scontrol requeue` (after it Slurm starts no step in the job): the RAM tier's scavenge
    # (jobs/launch/scavenge.py), bounded by itself; whatever it does, the requeue follows
    before_requeue: Callable[[], object] | None = None


def open_attempt(ctx: AttemptContext, **facts) -> None:
    """Records `attempt_start`, first closing earlier attempts whose end nobody wrote (their ranks
    were all killed): each becomes a `failure` of class `lost` and an `attempt_end`."""
    for a in unfinished(read_events(ctx.events.path), current=ctx.attempt):
        ctx.events.emit(
            "failure",
            attempt=a.attempt,
            cls="lost",
            summary="no rank of this attempt reported how it ended (the job or its nodes were killed)",
            suspects=[],
            reported_by_attempt=ctx.attempt,
        )
        ctx.events.emit("attempt_end", attempt=a.attempt, cause="lost", action="none", step=a.last_step)
    ctx.events.emit("attempt_start", job_id=ctx.job_id, world_size=ctx.world_size, **facts)


def conclude(
    ctx: AttemptContext, *, cause: str, step: int | None, incident: Incident | None = None, recorded: bool = False
) -> int:
    """Writes the incident (unless `recorded` already) and the ledger records, decides, requeues before anyone
    tears down, then publishes the decision; returns this process's exit code (the other ranks read it from
    the decision)."""
    return _conclude(ctx, cause=cause, step=step, incident=incident, recorded=recorded).exit_code


def _conclude(
    ctx: AttemptContext, *, cause: str, step: int | None, incident: Incident | None, recorded: bool
) -> Decision:
    """`conclude`, returning the decision. Whatever raises between the claim and the publish (a hand-edited file,
    a full disk, a bug) ends in `_last_resort`: the job is requeued and a decision published all the same."""
    done: dict = {}  # what has been done so far: slurm (its intent, once asked), scavenged, requeued
    try:
        d = _decide(ctx, cause=cause, step=step, incident=incident, recorded=recorded, done=done)
        if d.action == "requeue" and ctx.job_id:
            _before_requeue(ctx, done)
            excluded = d.excluded  # an update replaces the job's exclusion: cluster.exclude goes in again
            exclude = list(dict.fromkeys([*excluded, *ctx.always_excluded]))
            ok, said = requeue_excluding(ctx.job_id, exclude) if excluded else requeue_job(ctx.job_id)
            done["requeued"] = ok
            # A refusal is not turned into "stop": Slurm itself may be requeueing the job already (an
            # admin's `scontrol requeue`, preemption); otherwise exit 75 still says "run again".
            ctx.events.emit("requeue", job_id=ctx.job_id, ok=ok, scontrol=said, excluded=excluded)
    except Exception as e:  # noqa: BLE001 - the decision must be published and the job must not be lost
        d = _last_resort(ctx, cause=cause, error=e, done=done)
    # Only now: the supervisor ends the step on a published decision, and its batch script then ends
    # the job; published before the requeue reached Slurm, a "requeue" could end the job for good.
    _publish(ctx, d)
    log = get_logger()
    (log.error if d.action == "stop" else log.warning)(
        "attempt %s ended by %s -> %s (%s); exit %d", ctx.attempt, cause, d.action, d.reason, d.exit_code
    )
    if d.action == "stop":
        try:
            print(
                render_summary(read_events(ctx.events.path), title=f"stopped for good: {d.reason}; attempts"),
                flush=True,
            )
        except Exception as e:  # noqa: BLE001 - the summary is for reading only
            log.error("no summary of the attempts: %s", e)
    return d


def _before_requeue(ctx: AttemptContext, done: dict) -> None:
    """`ctx.before_requeue`, if any, once per decision (`done`: the normal path's, then `_last_resort`'s); a failure
    there is logged and never stops the requeue."""
    if ctx.before_requeue is not None and not done.get("scavenged"):
        done["scavenged"] = True
        try:
            ctx.before_requeue()
        except Exception as e:  # noqa: BLE001 - the requeue must happen
            get_logger().warning("before the requeue: %s: %s", type(e).__name__, e)


def _decide(
    ctx: AttemptContext, *, cause: str, step: int | None, incident: Incident | None, recorded: bool, done: dict
) -> Decision:
    """The incident and ledger records, and the decision (with its `excluded` nodes), before any Slurm action."""
    if incident is not None and not recorded:
        write_incident(ctx.run_dir, incident)
        ctx.events.emit(
            "failure",
            cls=incident.cls,
            summary=incident.summary,
            suspects=incident.suspects,
            reported_by=incident.reported_by,
        )
    # Whatever ended the attempt, a job that Slurm is cancelling (scancel, time limit) is not brought
    # back, and one that Slurm already requeues is not requeued twice.
    slurm = done["slurm"] = slurm_intent(ctx.job_id, restart_count=ctx.restart_count)
    suspects = [s["node"] for s in (incident.suspects if incident else []) if s.get("node")]
    # Only a class a restart can cure probes the suspects' nodes (an unhealthy GPU's node answers, and is still bad).
    probes: dict[str, tuple[str, str]] = {}  # node -> (verdict, what was seen): `probe_nodes`
    restart = _restart(ctx, suspects, slurm, cause=cause, probes=probes)
    d = decide(
        read_events(ctx.events.path),
        cause=cause,
        cfg=ctx.cfg,
        restart_count=ctx.restart_count,
        slurm=slurm,
        restart=restart,
        suspect_nodes=suspects,
    )
    sig = ctx.pending_stop() if ctx.pending_stop is not None and d.action == "restart" else None
    if sig:  # the time limit or a preemption is coming: a restarted step would start without the notice
        d = decide(read_events(ctx.events.path), cause=sig, cfg=ctx.cfg, restart_count=ctx.restart_count, slurm=slurm)
        d.reason = f"{cause}, and {sig} arrived: no restart inside the allocation; {d.reason}"
    d.excluded = _quarantine(ctx, d, incident, restart, probes=probes)
    ctx.events.emit("decision", cause=cause, **asdict(d))
    done["decision"] = d
    swapped = restart and d.action == "restart" and restart.bad_nodes and swap(restart.bad_nodes, restart.spares)
    if swapped:  # the supervisor's next placement leaves the quarantined nodes out and takes these spares
        ctx.events.emit("spare_swap", swapped=swapped, excluded=d.excluded)
    ctx.events.emit("attempt_end", cause=cause, action=d.action, step=step)
    return d


def _last_resort(ctx: AttemptContext, *, cause: str, error: Exception, done: dict) -> Decision:
    """The decision when the decision path raised: a requeue (exit 75, after `ctx.before_requeue` as any requeue)
    unless Slurm is already cancelling or requeueing the job, or the requeues counted so far spend
    failure.max_requeues (a path that always fails must not requeue forever); recorded where it can be (the
    ledger, else the job log)."""
    log, f = get_logger(), ctx.cfg
    log.error("attempt %s: the decision path failed (%s: %s)", ctx.attempt, type(error).__name__, error, exc_info=True)
    why = f"{cause}: the decision path failed ({type(error).__name__}: {error})"
    try:
        used = requeues_used(read_events(ctx.events.path), restart_count=ctx.restart_count)
    except Exception:  # noqa: BLE001 - the ledger may be what failed: Slurm's count, free requeues included
        used = ctx.restart_count
    facts = dict(requeues_used=used, max_requeues=f.max_requeues, attempts_without_progress=0)
    slurm, d = done.get("slurm"), done.get("decision")
    if d is not None:  # recorded already: only its requeue is left to do
        if d.action == "requeue" and ctx.job_id and not done.get("requeued"):
            _before_requeue(ctx, done)
            ok, said = requeue_job(ctx.job_id)
            _emit_or_log(ctx, "requeue", job_id=ctx.job_id, ok=ok, scontrol=said, excluded=[])
        return d
    if slurm == "cancelled":
        d = Decision("none", f"{why}; the job is being cancelled: not requeued", exitcodes.REQUEUE, **facts)
    elif slurm == "requeued" or done.get("requeued"):
        d = Decision("requeued_by_slurm", f"{why}; the job is requeued already", exitcodes.REQUEUE, **facts)
    elif used >= f.max_requeues:
        d = Decision(
            "stop",
            f"{why}; {used} requeues >= failure.max_requeues({f.max_requeues}): stopped",
            exitcodes.STOPPED,
            **facts,
        )
    else:
        d = Decision("requeue", f"{why}; requeued as a last resort, without exclusions", exitcodes.REQUEUE, **facts)
        if ctx.job_id:
            _before_requeue(ctx, done)
            ok, said = requeue_job(ctx.job_id)
            _emit_or_log(ctx, "requeue", job_id=ctx.job_id, ok=ok, scontrol=said, excluded=[])
    _emit_or_log(ctx, "decision", cause=cause, **asdict(d))
    _emit_or_log(ctx, "attempt_end", cause=cause, action=d.action, step=None)
    return d


def _emit_or_log(ctx: AttemptContext, kind: str, **fields) -> None:
    try:
        ctx.events.emit(kind, **fields)
    except Exception as e:  # noqa: BLE001 - the ledger may be what failed
        get_logger().error("ledger record %s not written (%s): %s", kind, e, json.dumps(fields, default=str))


def _publish(ctx: AttemptContext, d: Decision) -> None:
    """`publish`; the supervisor (rank -1), whose step is over, prints a decision it cannot write to the job log."""
    try:
        publish(ctx.run_dir, ctx.attempt, d)
    except OSError as e:
        if ctx.rank >= 0:
            raise
        get_logger().error("decision of attempt %s not published (%s): %s", ctx.attempt, e, json.dumps(asdict(d)))


def _restart(
    ctx: AttemptContext, suspects: list[str], slurm: str | None, *, cause: str, probes: dict | None = None
) -> Restart | None:
    """The facts for a restart inside the allocation: which suspects' nodes do not answer (probed, all at once,
    only when a restart is possible at all; a probe that slurmctld failed is no evidence: `probe_node`), and the
    allocation's idle spares (`jobs.failure.spares`). A node-pointing class that a restart does not cure (an
    unhealthy GPU, SDC) restarts only with its suspects' nodes swapped for spares; None when it cannot.
    `probes` receives what each probe found."""
    spares = spares_of(read_events(ctx.events.path), ctx.attempt)
    if cause not in RESTART_CLASSES:
        bad = list(dict.fromkeys(suspects))
        ok = cause in QUARANTINE_CLASSES and ctx.supervised and slurm is None and swap(bad, spares) and bad
        return Restart(True, ctx.restart_in_allocation, bad, spares) if ok else None
    if not ctx.supervised or slurm is not None or ctx.restart_in_allocation >= ctx.cfg.restarts_in_allocation:
        return Restart(ctx.supervised and slurm is None, ctx.restart_in_allocation, [], spares)
    found = probe_nodes(ctx.job_id, suspects, timeout_s=ctx.cfg.node_probe_timeout_s) if ctx.job_id else {}
    if probes is not None:
        probes.update(found)
    bad = [n for n in dict.fromkeys(suspects) if found.get(n, ("answers",))[0] == "silent"]
    return Restart(True, ctx.restart_in_allocation, bad, spares)


def _quarantine(
    ctx: AttemptContext, d: Decision, incident: Incident | None, restart: Restart | None, *, probes: dict | None = None
) -> list[str]:
    """A requeue after an incident that points at nodes (`QUARANTINE_CLASSES`) puts its suspects' nodes on
    the run's quarantine list, each with its evidence from the node itself (`_evidence`); every requeue excludes
    the whole list. When that leaves too few usable nodes, the decision becomes a stop that says so (not when
    Slurm cannot say). A restart that swaps spares in for bad nodes quarantines those nodes (whatever the class)
    and no others. Returns the list."""
    swapping = d.action == "restart" and restart is not None and bool(restart.bad_nodes)
    if d.action not in ("requeue", "requeued_by_slurm") and not swapping or not ctx.job_id:
        return []
    if incident is not None and (incident.cls in QUARANTINE_CLASSES or swapping):
        evidence = _evidence(ctx, incident, {} if probes is None else probes)
        nodes = restart.bad_nodes if swapping else list(evidence)
        if nodes:
            add_to_quarantine(
                ctx.run_dir,
                nodes,
                reason=f"suspect of a {incident.cls} incident",
                incident=ctx.attempt,
                evidence=evidence,
                ttl_h=ctx.cfg.quarantine_ttl_h,
            )
    excluded = sorted({e["node"] for e in quarantined(ctx.run_dir, ttl_h=ctx.cfg.quarantine_ttl_h)})
    if excluded and d.action == "requeue":
        usable = usable_nodes(ctx.partition, set(excluded))
        if usable is None:
            d.reason += "; sinfo could not say which nodes are usable: requeued without that check"
        elif len(usable) < ctx.nodes_needed:
            d.action, d.exit_code = "stop", exitcodes.STOPPED
            d.reason = (
                f"the quarantine ({', '.join(excluded)}; {ctx.run_dir}/quarantine.json) leaves "
                f"{len(usable)} usable node(s) in partition {ctx.partition or '(default)'}, the job needs "
                f"{ctx.nodes_needed}: check the nodes, then remove them from quarantine.json to requeue"
            )
    return excluded


# A dead or hung rank is evidence against its process, not its node: its node is quarantined only when the node
# itself says so (a probe it did not answer while slurmctld did), or when the fault recurs on that node.
_PROCESS_CLASSES = frozenset({"dead_rank", "hung_rank"})


def _evidence(ctx: AttemptContext, incident: Incident, probes: dict[str, tuple[str, str]]) -> dict[str, dict]:
    """node -> why it is suspect: the incident's class and summary, its suspects on that node (rank, pid, state,
    step, beat age, GPU...) and, for a dead or hung rank, the evidence from the node itself: its probe (run now,
    all at once, when the restart decision did not), or the same node suspect in an earlier attempt of the streak
    (`suspects_again`). Never a node whose suspect rank was a suspect on another node before: the fault follows
    the rank (its data, its code path), not the node."""
    out: dict[str, dict] = {}
    for s in incident.suspects:
        if s.get("node"):
            entry = out.setdefault(s["node"], {"cls": incident.cls, "summary": incident.summary, "suspects": []})
            entry["suspects"].append(s)
    if incident.cls not in _PROCESS_CLASSES:
        return out
    events = read_events(ctx.events.path)
    followed, again = _followed_rank(events, incident), set(suspects_again(events, list(out)))
    unprobed = [n for n in out if n not in probes and n not in followed]
    if unprobed and ctx.job_id:
        probes.update(probe_nodes(ctx.job_id, unprobed, timeout_s=ctx.cfg.node_probe_timeout_s))
    for node in list(out):
        verdict, said = probes.get(node, ("unknown", "not probed"))
        if node not in followed and verdict == "silent":
            out[node]["probe"] = f"no one-task step ran on it within failure.node_probe_timeout_s: {said}"
        elif node not in followed and node in again:
            out[node]["recurring"] = "suspect of an earlier attempt without progress as well"
        else:
            why = followed.get(node) or f"its probe: {verdict} ({said})"
            get_logger().warning("node %s not quarantined after a %s incident: %s", node, incident.cls, why)
            del out[node]
    return out


def _followed_rank(events: list[dict], incident: Incident) -> dict[str, str]:
    """node -> why: the incident's suspect nodes whose suspect rank was a dead or hung suspect of an earlier
    attempt on another node (the same rank failing on different nodes)."""
    earlier: dict[int, set[str]] = {}
    for e in events:
        if e.get("kind") == "failure" and e.get("cls") in _PROCESS_CLASSES and e.get("attempt") != incident.attempt:
            for s in e.get("suspects") or []:
                if s.get("rank") is not None and s.get("node"):
                    earlier.setdefault(s["rank"], set()).add(s["node"])
    out = {}
    for s in incident.suspects:
        others = earlier.get(s.get("rank"), set()) - {s.get("node")}
        if s.get("node") and others:
            out[s["node"]] = (
                f"rank {s['rank']} failed on {', '.join(sorted(others))} before: the fault follows the rank"
            )
    return out


def on_failure(
    ctx: AttemptContext,
    *,
    error: BaseException | None = None,
    during: str = "train",
    step: int | None = None,
    incident: Incident | None = None,
) -> int:
    """The failure path of one process; runs once per process (the watchdog thread and the main
    thread may both arrive here). Returns the exit code this process should end with."""
    with _once:
        if ctx.rank >= 0:
            dump_stacks(ctx.run_dir, ctx.attempt, ctx.rank)
        if not claim(ctx.run_dir, ctx.attempt, rank=ctx.rank):
            d = read_decision(ctx.run_dir, ctx.attempt, wait_s=decision_wait_s(ctx.cfg))
            return int(d["exit_code"]) if d else exitcodes.REQUEUE
        if incident is None:
            incident = _classified(ctx, error=error, during=during)
        get_logger().error("incident %s: %s", incident.cls, incident.summary)
        return conclude(ctx, cause=incident.cls, step=step, incident=incident)


def _classified(ctx: AttemptContext, *, error: BaseException | None, during: str) -> Incident:
    """`classify_settled`; when classifying itself fails (unreadable heartbeats), a `rank_crashed` incident
    without suspects that says so: the claim is held, so a decision must follow."""
    try:
        return classify_settled(
            run_dir=ctx.run_dir,
            world_size=ctx.world_size,
            me=ctx.rank,
            attempt=ctx.attempt,
            heartbeat_s=ctx.cfg.heartbeat_s,
            error=error,
            during=during,
        )
    except Exception as e:  # noqa: BLE001 - see the docstring
        get_logger().error(
            "attempt %s: the incident could not be classified (%s: %s)", ctx.attempt, type(e).__name__, e
        )
        what = f"{type(error).__name__}: {error}" if error is not None else "a failure"
        return Incident(
            "rank_crashed",
            ctx.attempt,
            ctx.rank,
            f"rank {ctx.rank} met {what} during {during}; not classified ({type(e).__name__}: {e})",
            [],
            {"classify_error": f"{type(e).__name__}: {e}"},
        )


def decide_for_lost_decider(ctx: AttemptContext, *, step_code: int) -> dict | None:
    """The supervisor's part when an attempt's step has ended (so every rank of it is gone) with the attempt
    claimed and no decision published: its decider died while deciding (killed, its node lost, its own
    failure path failed). Decides in its place, from the incident the decider wrote, else as a dead rank
    naming the decider, and returns the published decision; None when nobody claimed the attempt (it
    finished, or was stopped by a signal) or the decision is there."""
    who = claimant(ctx.run_dir, ctx.attempt)
    if who is None or read_decision(ctx.run_dir, ctx.attempt, wait_s=0) is not None:
        return None
    beats = read_beats(ctx.run_dir, ctx.attempt)
    path = incident_dir(ctx.run_dir, ctx.attempt) / "incident.json"
    try:
        fields = load_json(path)
        incident, recorded = Incident(**{k: v for k, v in fields.items() if k != "stacks"}), True
    except (OSError, ValueError, TypeError):
        incident, recorded = _dead_decider(ctx, who, beats), False
    get_logger().error(
        "attempt %s: the step ended (exit %d) without the decision that %s claimed; deciding in its place: %s",
        ctx.attempt,
        step_code,
        _who(who),
        incident.summary,
    )
    step = max((b.step for b in beats.values()), default=None)
    conclude(
        ctx, cause=incident.cls, step=step if step is None or step >= 0 else None, incident=incident, recorded=recorded
    )
    return read_decision(ctx.run_dir, ctx.attempt, wait_s=0)


def _who(who: dict) -> str:
    if who.get("rank") is None:
        return "a rank"
    return f"rank {who['rank']} (pid {who.get('pid')}, host {who.get('host')})"


def _dead_decider(ctx: AttemptContext, who: dict, beats: dict) -> Incident:
    """A `dead_rank` incident naming the decider (its node from its heartbeat), reported by the supervisor."""
    b = beats.get(who.get("rank"))
    suspects = (
        [
            {
                "rank": b.rank,
                "node": b.node,
                "host": b.host,
                "pid": b.pid,
                "state": "dead",
                "step": b.step,
                "phase": b.phase,
            }
        ]
        if b is not None
        else []
    )
    return Incident(
        "dead_rank",
        ctx.attempt,
        ctx.rank,
        f"{_who(who)} claimed the decision of attempt {ctx.attempt} and died before publishing it",
        suspects,
        {"claim": who},
    )


def decide_for_silent_attempt(
    ctx: AttemptContext, *, step_code: int, why: str, cls: str = "dead_rank", tasks: dict[int, int] | None = None
) -> dict | None:
    """The supervisor's part when a rank of the step is gone (`why`: its exit record or srun's line; `tasks`: each
    task's exit code, kept as evidence) and the step ended
    with nobody having claimed the attempt: the ranks' failure path could not even claim it (a full or
    read-only incidents folder). Decides in their place, as a `dead_rank` without suspects (a rank that could
    not write is no evidence against its node), with the ranks' policy and budgets: a restart in the
    allocation, a requeue or a stop (`cls` names another class: `step_launch_failure`). Records what it can
    (the ledger, else the job log) and returns the decision even when it could not be published; None when
    someone claimed or decided the attempt."""
    if claimant(ctx.run_dir, ctx.attempt) is not None or read_decision(ctx.run_dir, ctx.attempt, wait_s=0) is not None:
        return None
    try:
        if not claim(ctx.run_dir, ctx.attempt, rank=ctx.rank):
            return None
    except OSError as e:  # every rank of the step is gone: nobody else can decide
        get_logger().error("attempt %s: cannot claim its decision (%s); deciding without a claim", ctx.attempt, e)
    beats = read_beats(ctx.run_dir, ctx.attempt)
    step = max((b.step for b in beats.values() if b.step >= 0), default=None)
    incident = Incident(
        cls,
        ctx.attempt,
        ctx.rank,
        f"{why}, and no rank claimed or published a decision (their failure path could not write?)",
        [],
        {"srun": why, "step_exit_code": step_code, **({"task_exit_codes": tasks} if tasks else {})},
    )
    get_logger().error("attempt %s: deciding in the ranks' place: %s", ctx.attempt, incident.summary)
    e = ctx.events
    d = _conclude(
        replace(ctx, events=_LedgerOrLog(e.path, rank=e.rank, restart=e.restart, attempt=e.attempt)),
        cause=incident.cls,
        step=step,
        incident=incident,
        recorded=False,
    )
    return read_decision(ctx.run_dir, ctx.attempt, wait_s=0) or asdict(d)


class _LedgerOrLog(EventLog):
    """The ledger, for a supervisor deciding in the place of ranks that could not write: a record the ledger
    refuses (a full or read-only disk) goes to the job log instead."""

    def emit(self, kind: str, **fields) -> dict:
        try:
            return super().emit(kind, **fields)
        except OSError as e:
            record = {"kind": kind, "attempt": self.attempt, **fields}
            get_logger().error("ledger %s not written (%s): %s", self.path, e, json.dumps(record, default=str))
            return record
